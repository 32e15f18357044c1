"""Dynamic draft trees (`dyn:kKdDnN`, EAGLE-2): each step verifies the N candidates of highest draft score, grown by a
beam of K. The trees the engine grows are checked against EAGLE-2's procedure recomputed from scratch (a dense draft
forward over the whole context for every candidate, no caches, stash or masks); exactness against plain decoding is in
tests/test_spec.py and the sampled law in tests/test_spec_distribution.py."""
import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.engine.runner import ModelRunner
from eyas.spec import step as step_mod
from eyas.spec.dynamic_tree import DynamicTree
from eyas.spec.tree import resolve_tree
from helpers import write_random_draft, write_tiny_llama


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


def test_a_dynamic_tree_is_refused_where_it_cannot_run(pair):
    target_dir, draft_dir = pair
    with pytest.raises(ValueError, match="top-30 of a draft that proposes from 29 tokens"):
        LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation="dyn:k30d2n3")
    from eyas.spec.step import spec_step
    with pytest.raises(ValueError, match="needs a draft"):
        spec_step(None, None, resolve_tree("dyn:k2d2n3"), None, None, None, 4)
    with pytest.raises(ValueError, match="cannot be replayed"):
        spec_step(None, object(), resolve_tree("dyn:k2d2n3"), None, None, None, 4, simulated_accept=torch.ones(2))
