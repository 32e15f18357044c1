"""Dynamic draft trees (`dyn:kKdDnN`, EAGLE-2): each step verifies the N candidates of highest draft score, grown by a
beam of K. The trees the engine grows are checked against EAGLE-2's procedure recomputed from scratch (a dense draft
forward over the whole context for every candidate, no caches, stash or masks); exactness against plain decoding is in
tests/test_spec.py and the sampled law in tests/test_spec_distribution.py."""
import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.engine.runner import ModelRunner
from eyas.spec import dynamic_tree as dyn_mod
from eyas.spec import step as step_mod
from eyas.spec.dynamic_tree import DynamicTree
from eyas.spec.tree import resolve_tree
from helpers import write_random_draft, write_tiny_llama

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton selection: on the GPU, or interpreted on the CPU


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("dyn")
    target = write_tiny_llama(d / "t", vocab=29, hidden=32, heads=4, kv_heads=2, layers=2, seed=4)
    return target, write_random_draft(d / "d", target, layers=1, seed=6, scale=2.0)


def test_spelling_and_its_errors():
    t = resolve_tree("dyn:k8d6n48")
    assert isinstance(t, DynamicTree) and (t.topk, t.max_depth, t.num_nodes) == (8, 6, 48)
    assert t.name == "dyn:k8d6n48" and t.pool_size == 8 + 5 * 64
    assert resolve_tree("dyn:k3d1n3").pool_size == 3
    for bad, msg in [("dyn:8,6,48", "expected dyn:kKdDnN"), ("dyn:kad2n3", "expected dyn:kKdDnN"),
                     ("dyn:k0d3n4", ">= 1"), ("dyn:k2d3n0", ">= 1"), ("dyn:k3d1n4", "more than the 3 candidates"),
                     ("dyn:k2d3n11", "more than the 10 candidates")]:
        with pytest.raises(ValueError, match=msg):
            resolve_tree(bad)
    assert resolve_tree("dispatch:2=dyn:k2d3n4,8=chain:2").tree_for(1).name == "dyn:k2d3n4"


def eagle2_reference(target, draft, ids: list[int], K: int, D: int, N: int) -> set[tuple[int, ...]]:
    """EAGLE-2's tree after the committed tokens `ids` (the last one the root), as token paths below the root, from
    dense forwards: the target's features of the context, then for every candidate the draft over the whole
    sequence (the committed pairs, then the candidate's path, each node paired with its parent's draft output)."""
    n = len(ids) - 1
    with torch.no_grad():
        h = target(torch.tensor([ids[:n]]), torch.arange(n)[None])  # [1, n, H]: the features h_t, t < n

        def outputs(path: tuple[int, ...]) -> torch.Tensor:
            """The draft's output at the last node of `path` (the root's for the empty path)."""
            toks = torch.tensor([ids[1:] + list(path)])
            feats = h
            out = None
            for j in range(len(path) + 1):  # each node's feature is its parent's output: grow one node at a time
                L = n + j
                out = draft(target.embed(toks[:, :L]), feats[:, :L], torch.arange(L)[None])
                feats = torch.cat([h, out[:, n - 1:]], dim=1)
            return out[0, -1]

        def top(path):
            logp = torch.log_softmax(target.compute_logits(outputs(path)[None]).float()[0], -1)
            v, i = torch.topk(logp, K)
            return list(zip(v.tolist(), i.tolist()))

        beam = [(lp, (t,)) for lp, t in top(())]
        cands = list(beam)
        for _ in range(1, D):
            children = [(s + lp, path + (t,)) for s, path in beam for lp, t in top(path)]
            cands += children
            beam = sorted(children, key=lambda c: -c[0])[:K]
    return {path for _, path in sorted(cands, key=lambda c: -c[0])[:N]}


def tree_paths(node_tokens: torch.Tensor, parents: torch.Tensor) -> list[tuple[int, ...]]:
    """Node i's token path below the root (parents come before children)."""
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (int(node_tokens[i]),))
    return paths


@pytest.mark.parametrize("spec", ["dyn:k3d4n10", "dyn:k4d3n7", "dyn:k2d5n9"])
def test_trees_are_eagle2s_selection(pair, monkeypatch, spec):
    target_dir, draft_dir = pair
    tree = resolve_tree(spec)
    K, D, N = tree.topk, tree.max_depth, tree.num_nodes
    seen = []  # per step: the sequences' committed tokens, then what expand_dynamic returned
    launch, expand = ModelRunner.launch, step_mod.expand_dynamic

    def spy_launch(self, seqs, after=None):
        seen.append([list(s.token_ids) for s in seqs])
        return launch(self, seqs, after)

    def spy_expand(*args, **kw):
        out = expand(*args, **kw)
        seen[-1] = (seen[-1], out)
        return out

    monkeypatch.setattr(ModelRunner, "launch", spy_launch)
    monkeypatch.setattr(step_mod, "expand_dynamic", spy_expand)
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation=spec)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 29, (k,), generator=g).tolist() for k in (3, 8, 13)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    steps = [s for s in seen if isinstance(s, tuple)]
    assert len(steps) >= 4
    checked = 0
    for ids_list, (node_tokens, grown) in steps[:4]:
        assert node_tokens.shape == (len(ids_list), N + 1) and grown.max_depth == D
        for b, ids in enumerate(ids_list):
            assert int(node_tokens[b, 0]) == ids[-1]
            paths = tree_paths(node_tokens[b], grown.parents[b].tolist())
            assert len(set(paths)) == N + 1  # distinct nodes, the root included
            assert grown.depth[b].tolist() == [len(p) for p in paths]
            anc = [[paths[i][:len(paths[j])] == paths[j] for j in range(N + 1)] for i in range(N + 1)]
            assert grown.ancestor_mask[b].tolist() == anc
            assert set(paths[1:]) == eagle2_reference(llm.target, llm.draft, ids, K, D, N)
            checked += 1
    assert checked >= 8
    assert sum(sum(o.stats.accepted_by_depth) for o in outs) > 0  # some draft tokens were accepted


@pytest.mark.parametrize("spec", ["dyn:k3d4n10", "dyn:k6d8n30"])  # pools of 30 and 258: one block, and several
def test_the_one_launch_selection_equals_the_torch_one(pair, monkeypatch, spec):
    """The Triton selection (`eyas.kernels.select_tree`, under the interpreter on the CPU) gives every output of
    `select_tree_torch` on the pools of real steps (batch 3), and again with their scores rounded to a few values, so
    that many candidates tie and the pool order must break the ties (rounding keeps a child at or below its parent), and
    with the best path ending at the pool's last candidate."""
    from eyas.kernels.select_tree import select_tree_triton
    target_dir, draft_dir = pair
    pools = []
    select = dyn_mod.select_tree

    def spy(*args):
        pools.append(args)
        return select(*args)

    monkeypatch.setattr(dyn_mod, "select_tree", spy)
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation=spec)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 29, (k,), generator=g).tolist() for k in (4, 9, 2)]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(pools) >= 3 and pools[0][0].shape[0] == 3
    ties = 0
    for args in pools[:3]:
        rounded = (torch.round(args[0] * 2) / 2,) + args[1:]
        ties += int((rounded[0][:, :, None] == rounded[0][:, None, :]).sum()) - rounded[0].numel()
        last = args[0].clone()  # the path to the pool's last candidate scores 0: the best of all, at the pool's end
        for b in range(last.shape[0]):
            last[b, args[2][b, -1]] = 0.0
        for a in (args, rounded, (last,) + args[1:]):
            want = dyn_mod.select_tree_torch(*a)
            got = select_tree_triton(*(x.to(DEV) if isinstance(x, torch.Tensor) else x for x in a))
            for w, o in zip(want, got):
                assert o.dtype == w.dtype and torch.equal(o.cpu(), w)
    assert ties > 100


@pytest.mark.parametrize("spec", ["dyn:k3d4n10", "dyn:k6d4n30"])
def test_the_one_launch_beam_level_equals_the_torch_one(pair, monkeypatch, spec):
    """The Triton beam level (`eyas.kernels.dyn_beam`, interpreted on the CPU) writes the pool and returns the next
    beam as `grow_pool_torch` does, on the levels of real steps (batch 3), and with the beam's scores and the
    children's log-probabilities rounded, or all 0, so that children tie and the earlier one must win."""
    from eyas.kernels.dyn_beam import grow_pool_triton
    target_dir, draft_dir = pair
    levels = []
    grow = dyn_mod.grow_pool

    def spy(*args, **kw):
        levels.append((tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), kw))
        return grow(*args, **kw)

    monkeypatch.setattr(dyn_mod, "grow_pool", spy)
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation=spec)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 29, (k,), generator=g).tolist() for k in (5, 2, 11)]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(levels) >= 6 and {kw["next_beam"] for _, kw in levels} == {True, False}
    for args, kw in levels[:6]:
        rounded = (torch.round(args[0]), torch.round(args[1])) + args[2:]
        flat = (torch.zeros_like(args[0]), torch.zeros_like(args[1])) + args[2:]  # every child ties
        for a in (args, rounded, flat):
            want_pool = [x.clone() for x in a[6:9]]
            want = dyn_mod.grow_pool_torch(*a[:6], *want_pool, *a[9:], **kw)
            got_pool = [x.clone().to(DEV) for x in a[6:9]]
            got = grow_pool_triton(*(x.to(DEV) for x in a[:6]), *got_pool, *a[9:], **kw)
            off, KK = a[9], a[0].shape[1] ** 2
            for w, o in zip(want_pool, got_pool):  # the level's slice of the pool (the rest is not written)
                assert torch.equal(o[:, off:off + KK].cpu(), w[:, off:off + KK])
            assert (got is None) == (want is None)
            for w, o in zip(want or (), got or ()):
                assert o.dtype == w.dtype and torch.equal(o.cpu(), w)


def test_a_dynamic_tree_is_refused_where_it_cannot_run(pair):
    target_dir, draft_dir = pair
    with pytest.raises(ValueError, match="top-30 of a draft that proposes from 29 tokens"):
        LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation="dyn:k30d2n3")
    from eyas.spec.step import spec_step
    with pytest.raises(ValueError, match="needs a draft"):
        spec_step(None, None, resolve_tree("dyn:k2d2n3"), None, None, None, 4)
    with pytest.raises(ValueError, match="cannot be replayed"):
        spec_step(None, object(), resolve_tree("dyn:k2d2n3"), None, None, None, 4, simulated_accept=torch.ones(2))
