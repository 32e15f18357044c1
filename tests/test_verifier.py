"""Greedy acceptance without a walk (`accept_tree_greedy`) equals the multi-round speculative sampler (`accept_tree`)
at one-hot target distributions, on random trees and on the shipped presets: same path, same count, same bonus. The
sampler itself (every node's rounds at once) equals the walk that tries one child at a time
(`accept_tree_reference`) at any distributions."""
import os

import torch

if not torch.cuda.is_available():  # before Triton is first imported: its kernel runs in the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eyas.spec.tree import PRESETS, Tree, resolve_tree  # noqa: E402
from eyas.layers.sampler import logits_to_probs, race_sample, row_stats  # noqa: E402
from eyas.spec.verifier import accept_tree, accept_tree_greedy, accept_tree_logits, accept_tree_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

V = 12  # a small vocabulary (above the widest preset node, 10 children): random tokens often collide


def random_tree(rng: torch.Generator, max_nodes: int, max_width: int) -> Tree:
    paths: list[tuple[int, ...]] = []
    frontier = [()]
    while frontier and len(paths) < max_nodes:
        parent = frontier.pop(int(torch.randint(len(frontier), (1,), generator=rng)))
        width = int(torch.randint(1, max_width + 1, (1,), generator=rng))
        # ranks need not be contiguous (fitted trees skip some)
        ranks = sorted(torch.randperm(max_width + 1, generator=rng)[:width].tolist())
        for r in ranks:
            if len(paths) < max_nodes and len(parent) < 7:
                paths.append(parent + (r,))
                frontier.append(parent + (r,))
    return Tree.from_paths([list(p) for p in paths], "random")


def draft_tokens(tree: Tree, B: int, rng: torch.Generator) -> torch.Tensor:
    """[B, N+1] node tokens; siblings distinct (the draft's top-k are distinct tokens)."""
    toks = torch.zeros(B, tree.num_nodes + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(V, (B,), generator=rng)
    for p in range(tree.num_nodes + 1):
        kids = tree.children[p][tree.children[p] >= 0]
        for b in range(B):
            toks[b, kids] = torch.randperm(V, generator=rng)[: len(kids)]
    return toks


def case(tree: Tree, B: int, rng: torch.Generator):
    """(node tokens, the target's tokens) [B, N+1] for `tree`, biased toward acceptance: where a node has children,
    the target often picks one of them."""
    nodes = draft_tokens(tree, B, rng)
    target = torch.randint(V, (B, tree.num_nodes + 1), generator=rng)
    for p in range(tree.num_nodes + 1):
        kids = tree.children[p][tree.children[p] >= 0]
        if len(kids):
            pick = kids[torch.randint(len(kids), (B,), generator=rng)]
            use = torch.rand(B, generator=rng) < 0.7
            target[use, p] = nodes[use, pick[use]]
    return nodes, target


def check(tree: Tree, B: int, seed: int, triton: bool = False) -> torch.Tensor:
    rng = torch.Generator().manual_seed(seed)
    nodes, target = case(tree, B, rng)
    probs = torch.nn.functional.one_hot(target, V).float()
    seeds = torch.arange(B)
    want = accept_tree(probs, nodes, tree, seeds, torch.zeros(B, dtype=torch.long))
    got = accept_tree_greedy(target, nodes, tree)
    for w, g, name in zip(want, got, ("path", "num_accepted", "bonus")):
        assert torch.equal(w, g), (name, w, g)
    if triton:  # the one-launch Triton kernel of the fast path: the same again
        from eyas.kernels.accept_greedy import accept_tree_greedy_triton
        *fast, packed = accept_tree_greedy_triton(target.to(DEV), nodes.to(DEV), tree.to(DEV))
        for w, g, name in zip(want, fast, ("path", "num_accepted", "bonus")):
            assert torch.equal(w, g.cpu()), ("triton", name, w, g)
        # the packed output the host reads: num_accepted, the path's tokens (the root's past the path), bonus
        path_tokens = nodes.gather(1, want[0].clamp(min=0))
        assert torch.equal(packed.cpu(), torch.cat([want[1][:, None], path_tokens, want[2][:, None]], 1))
    return want[1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 5), st.integers(0, 10**6))
def test_greedy_acceptance_equals_the_sampler_at_one_hot(max_nodes, max_width, B, seed):
    check(random_tree(torch.Generator().manual_seed(seed), max_nodes, max_width), B, seed)


def test_greedy_acceptance_on_the_presets():
    for i, name in enumerate(("mc_sim_7b_63", "16", "smollm2_128")):
        tree = Tree.from_paths(PRESETS[name], name)
        for seed in range(5):
            check(tree, 8, 100 * i + seed)
    # chains too, and the accepted lengths cover every value (the oracle sees full and empty acceptance)
    tree = Tree.chain(3)
    seen = set()
    for seed in range(40):
        rng = torch.Generator().manual_seed(seed)
        nodes = draft_tokens(tree, 16, rng)
        target = torch.where(torch.rand(16, 4, generator=rng) < 0.6, torch.roll(nodes, -1, 1),
                             torch.randint(V, (16, 4), generator=rng))
        seen |= set(accept_tree_greedy(target, nodes, tree)[1].tolist())
        check(tree, 16, seed)
    assert seen == {0, 1, 2, 3}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 4), st.integers(0, 10**6))
def test_replayed_acceptance_equals_the_tree_builder_replay(max_nodes, max_width, seed):
    """`simulate_replay` stepped on the device (a sequence's position advancing by what it commits) makes the target
    calls and commits the tokens of `eyas.spec.tree_builder.replay` over the same rank paths."""
    from eyas.spec.tree_builder import MISS, replay
    from eyas.spec.verifier import simulate_replay
    g = torch.Generator().manual_seed(seed)
    tree = random_tree(g, max_nodes, max_width)
    T, R, M = 300, 8, 120
    ranks = torch.randint(0, max_width + 1, (T, R), generator=g)  # often on the tree: long accepted paths
    ranks[torch.rand(T, R, generator=g) < 0.1] = MISS
    calls = committed = 0
    n, produced = torch.ones(1, dtype=torch.long), 1  # seed 0, position 1: replay's first root is row 1
    nodes = torch.zeros(1, tree.num_nodes + 1, dtype=torch.long)
    while produced < M:
        path, acc, _ = simulate_replay(nodes, tree, ranks, torch.zeros(1, dtype=torch.long), n, nodes)
        a = int(acc)
        assert path[0, a] >= 0 and (a == tree.max_depth or path[0, a + 1] < 0)
        k = min(a + 1, M - produced)
        calls, committed, produced, n = calls + 1, committed + k, produced + k, n + a + 1
    assert (calls, committed) == replay(ranks, [list(p) for p in tree.paths], M)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 5), st.integers(0, 10**6))
def test_triton_greedy_acceptance_equals_the_sampler(max_nodes, max_width, B, seed):
    check(random_tree(torch.Generator().manual_seed(seed), max_nodes, max_width), B, seed, triton=True)


def test_triton_greedy_acceptance_on_the_presets():
    """The largest fitted tree (129 rows: the ancestor mask in several row chunks) and a chain; the accepted depths
    seen cover empty and deep acceptance."""
    seen = set()
    for i, name in enumerate(("smollm2_128", "mc_sim_7b_63")):
        tree = Tree.from_paths(PRESETS[name], name)
        for seed in range(3):
            seen |= set(check(tree, 8, 200 * i + seed, triton=True).tolist())
    check(Tree.chain(3), 6, 7, triton=True)
    assert 0 in seen and max(seen) >= 3, seen


def step_tree_of(trees: list[Tree]):
    """The trees of one step, one per sequence (`StepTree`, as a dynamic tree gives), from static trees of one size
    (children padded to one width)."""
    from eyas.spec.dynamic_tree import StepTree
    W = max(t.children.shape[1] for t in trees)
    pad = [torch.nn.functional.pad(t.children, (0, W - t.children.shape[1]), value=-1) for t in trees]
    return StepTree(torch.stack([t.parents for t in trees]), torch.stack([t.depth for t in trees]),
                    torch.stack([t.ancestor_mask for t in trees]), torch.stack(pad), max(t.max_depth for t in trees))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 30), st.integers(1, 4), st.integers(2, 4), st.integers(0, 10**6))
def test_a_tree_per_sequence_equals_each_sequence_on_its_own(max_nodes, max_width, B, seed):
    """A step's dynamic trees (a different tree for each sequence): the sampler at one-hot, the greedy reference and
    its Triton launch each give every sequence what its own tree gives it alone."""
    from eyas.kernels.accept_greedy import accept_tree_greedy_triton
    rng = torch.Generator().manual_seed(seed)
    trees = [random_tree(rng, max_nodes, max_width)]
    for _ in range(200):
        if len(trees) == B:
            break
        t = random_tree(rng, trees[0].num_nodes, max_width)
        if t.num_nodes == trees[0].num_nodes:
            trees.append(t)
    trees += [trees[0]] * (B - len(trees))
    rows = [case(t, 1, rng) for t in trees]
    nodes, target = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    alone = [accept_tree_greedy(tgt, nd, t) for (nd, tgt), t in zip(rows, trees)]
    D = max(t.max_depth for t in trees)
    want = (torch.cat([torch.nn.functional.pad(a[0], (0, D - t.max_depth), value=-1) for a, t in zip(alone, trees)]),
            torch.cat([a[1] for a in alone]), torch.cat([a[2] for a in alone]))
    step, on_dev = step_tree_of(trees), step_tree_of([t.to(DEV) for t in trees])
    probs = torch.nn.functional.one_hot(target, V).float()
    for got, how in [(accept_tree(probs, nodes, step, torch.arange(B), torch.zeros(B, dtype=torch.long)), "sampler"),
                     (accept_tree_greedy(target, nodes, step), "greedy"),
                     (accept_tree_greedy_triton(target.to(DEV), nodes.to(DEV), on_dev)[:3], "triton")]:
        for w, g, name in zip(want, got, ("path", "num_accepted", "bonus")):
            assert torch.equal(w, g.cpu()), (how, name, w, g)


def check_sampler(tree, nodes: torch.Tensor, target: torch.Tensor, rng: torch.Generator, dev_tree=None) -> torch.Tensor:
    """`accept_tree` == `accept_tree_reference` at soft distributions drawn around `target` (mostly a draft token:
    deep paths), some tokens at probability 0, and the node tokens as given (siblings may repeat a token)."""
    B, N1 = nodes.shape
    soft = torch.softmax(torch.randn(B, N1, V, generator=rng) * 2, -1)
    mix = torch.rand(B, N1, 1, generator=rng)
    probs = mix * soft + (1 - mix) * torch.nn.functional.one_hot(target, V).float()
    probs = probs.masked_fill(torch.rand(B, N1, V, generator=rng) < 0.2, 0.0)
    seeds, counters = torch.randint(0, 10**6, (B,), generator=rng), torch.randint(0, 10**4, (B,), generator=rng)
    want = accept_tree_reference(probs, nodes, tree, seeds, counters)
    # the bonus raced on logits whose softmax is probs (the filtered steps' way: `race`)
    race = (probs.log(), torch.ones(B))
    want_race = accept_tree_reference(probs, nodes, tree, seeds, counters, race=race)
    assert torch.equal(want[0], want_race[0]) and torch.equal(want[1], want_race[1])
    for triton in (False, True):  # the uniforms in torch ops, or in one Triton launch
        for r, w_all in ((None, want), (race, want_race)):
            got = accept_tree(probs.to(DEV), nodes.to(DEV), dev_tree or tree.to(DEV), seeds.to(DEV),
                              counters.to(DEV), use_triton=triton, race=r and tuple(x.to(DEV) for x in r))
            for w, g, name in zip(w_all, got, ("path", "num_accepted", "bonus")):
                assert torch.equal(w, g.cpu()), (triton, r is None, name, w, g)
    return want[1]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 700), st.booleans(), st.integers(0, 10**6))
def test_triton_uniforms_are_the_reference_bits(B, M, shared, seed):
    """`uniform_triton` == `uniform` bit for bit: any int64 seeds (negative too), counters and indices, an index
    per row or one for all rows."""
    from eyas.kernels.uniform import uniform_triton
    from eyas.layers.sampler import uniform
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-2**63, 2**63 - 1, (B,), generator=g)
    counters = torch.randint(0, 2**40, (B,), generator=g)
    index = torch.randint(0, 2**31, (M,) if shared else (B, M), generator=g)
    want = uniform(seeds[:, None], counters[:, None], index)
    got = uniform_triton(seeds.to(DEV), counters.to(DEV), index.to(DEV)).cpu()
    assert got.shape == (B, M) and torch.equal(got, want.expand(B, M))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 6), st.booleans(), st.integers(0, 10**6))
def test_the_sampler_equals_the_walk(max_nodes, max_width, B, repeats, seed):
    check_sampler(*random_case(max_nodes, max_width, B, repeats, seed))


def random_case(max_nodes: int, max_width: int, B: int, repeats: bool, seed: int, liked: bool = False):
    """(tree, node tokens, target tokens, rng) of a random tree. `repeats`: tokens drawn anew from 4, siblings' too
    (a repeated sibling token is worth nothing the second time); `liked`: the targets too, so that the target likes
    the repeated tokens and a repeat's second round matters."""
    rng = torch.Generator().manual_seed(seed)
    tree = random_tree(rng, max_nodes, max_width)
    nodes, target = case(tree, B, rng)
    if repeats:
        nodes = torch.randint(4, (B, tree.num_nodes + 1), generator=rng)
        if liked:
            target = torch.randint(4, (B, tree.num_nodes + 1), generator=rng)
    return tree, nodes, target, rng


def test_the_sampler_equals_the_walk_on_the_presets_and_dynamic_trees():
    rng = torch.Generator().manual_seed(0)
    deepest = {}
    for name in ("chain:0", "chain:3", "tree:8", "tree:smollm2_48d5", "tree:mc_sim_7b_63"):
        tree = resolve_tree(name) if name != "chain:0" else Tree.chain(0)  # chain:0: plain sampled decoding
        nodes, target = case(tree, 64, rng)
        deepest[name] = int(check_sampler(tree, nodes, target, rng).max())
    assert deepest["tree:smollm2_48d5"] >= 3 and deepest["chain:3"] == 3  # deep paths were walked
    trees = [random_tree(rng, 12, 3) for _ in range(40)]
    trees = [t for t in trees if t.num_nodes == 12][:4]
    rows = [case(t, 1, rng) for t in trees]
    check_sampler(step_tree_of(trees), torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), rng,
                  step_tree_of([t.to(DEV) for t in trees]))


def check_filtered_sampler(tree, nodes: torch.Tensor, target: torch.Tensor, rng: torch.Generator,
                           dev_tree=None) -> torch.Tensor:
    """`accept_tree_logits(filters=...)` (torch, and the Triton radix selection and race) == the walk on the filtered
    softmaxes as `filter_threshold` states them, with the race's bonus: bf16 logits (ties at the boundaries), top-k,
    top-p and min-p per sequence, some greedy rows and some without a filter."""
    from eyas.layers.sampler import filter_threshold
    B, N1 = nodes.shape
    logits = torch.randn(B, N1, V, generator=rng) * 2
    logits += torch.nn.functional.one_hot(target, V) * 4 * torch.rand(B, N1, 1, generator=rng)
    logits = logits.bfloat16()
    temp = torch.tensor([0.0, 0.5, 1.0, 2.0])[torch.randint(4, (B,), generator=rng)]
    top_k = torch.tensor([-1, 1, 3, V])[torch.randint(4, (B,), generator=rng)]
    top_p = torch.tensor([1.0, 0.3, 0.8, 0.95])[torch.randint(4, (B,), generator=rng)]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.3])[torch.randint(4, (B,), generator=rng)]
    seeds, counters = torch.randint(0, 10**6, (B,), generator=rng), torch.randint(0, 10**4, (B,), generator=rng)
    flat = B * N1
    tau, M, Z, _ = filter_threshold(logits.view(flat, V), temp.repeat_interleave(N1), top_k.repeat_interleave(N1),
                                    top_p.repeat_interleave(N1), min_p.repeat_interleave(N1))
    x = logits.view(flat, V).float() / torch.where(temp > 0, temp, 1.0).repeat_interleave(N1)[:, None]
    probs = torch.where(x >= tau[:, None], torch.exp(x - M[:, None]) / Z[:, None], 0.0).view(B, N1, V)
    want = accept_tree_reference(probs, nodes, tree, seeds, counters, race=(logits, temp))
    on = [x.to(DEV) for x in (logits, temp, nodes)]
    filters = tuple(f.to(DEV) for f in (top_k, top_p, min_p))
    for triton in (False, True):
        got = accept_tree_logits(*on, dev_tree or tree.to(DEV), seeds.to(DEV), counters.to(DEV), use_triton=triton,
                                 filters=filters)
        for w, g, name in zip(want, got, ("path", "num_accepted", "bonus")):
            assert torch.equal(w, g.cpu()), (triton, name, temp, top_k, top_p, min_p, w, g)
    return want[1]


def test_the_filtered_logits_sampler_on_a_preset_and_plain_steps():
    rng = torch.Generator().manual_seed(2)
    for name in ("chain:0", "tree:smollm2_48d5"):
        tree = resolve_tree(name) if name != "chain:0" else Tree.chain(0)
        nodes, target = case(tree, 16, rng)
        check_filtered_sampler(tree, nodes, target, rng)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 6), st.sampled_from([5, 64, 300, 2100, 4099]), st.booleans(), st.integers(0, 10**6))
def test_filter_thresholds_by_radix_selection_equal_the_sort(R, vocab, bf16, seed):
    """`filter_threshold_triton` (radix selection) == `filter_threshold` (a sort): the same threshold, maximum and
    argmax (the first of tied maxima), the kept mass to float rounding; bf16 logits tie often at the
    boundaries, -inf tokens, k at 1, V - 1 and V, greedy rows, rows of more than one histogram chunk. And on float32
    logits (no ties) the kept sets are `logits_to_probs`' own."""
    from eyas.kernels.filter_threshold import filter_threshold_triton
    from eyas.layers.sampler import filter_threshold
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, vocab, generator=g) * 3).masked_fill(torch.rand(R, vocab, generator=g) < 0.05,
                                                                   float("-inf"))
    logits[:, 0] = logits[:, 0].clamp(min=0)  # never a row of -inf alone
    if bf16:  # ties, at the maximum too (the argmax is the first)
        logits[0, -1] = logits[0].max()
        logits = logits.bfloat16()
    temp = torch.tensor([0.0, 0.3, 1.0, 1.7])[torch.randint(4, (R,), generator=g)]
    top_k = torch.tensor([-1, 0, 1, 2, 7, vocab - 1, vocab, vocab + 5])[torch.randint(8, (R,), generator=g)]
    top_p = torch.tensor([1.0, 0.05, 0.5, 0.9, 0.999])[torch.randint(5, (R,), generator=g)]
    min_p = torch.tensor([0.0, 0.0, 0.01, 0.2, 0.9])[torch.randint(5, (R,), generator=g)]
    want = filter_threshold(logits, temp, top_k, top_p, min_p)
    got = [x.cpu() for x in filter_threshold_triton(*(x.to(DEV) for x in (logits, temp, top_k, top_p, min_p)))]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=0)
    if not bf16:
        probs = logits_to_probs(logits, temp, top_k, top_p, min_p)
        x = logits / torch.where(temp > 0, temp, 1.0)[:, None]
        assert torch.equal(probs > 0, (x >= want[0][:, None]) & (x > float("-inf")))


def check_logits_sampler(tree, nodes: torch.Tensor, target: torch.Tensor, rng: torch.Generator,
                         dev_tree=None) -> torch.Tensor:
    """`accept_tree_logits` (torch, and Triton) == the walk on softmax(logits / t) with the race's bonus
    (`accept_tree_reference(..., race=)`): bf16 logits peaked at `target` (deep paths), a greedy row or more, tokens
    masked to -inf as a grammar masks them (never a whole row), the node tokens as given."""
    B, N1 = nodes.shape
    logits = torch.randn(B, N1, V, generator=rng) * 2
    logits += torch.nn.functional.one_hot(target, V) * 6 * torch.rand(B, N1, 1, generator=rng)
    masked = (torch.rand(B, N1, V, generator=rng) < 0.2) & (torch.nn.functional.one_hot(target, V) == 0)
    logits = logits.masked_fill(masked, float("-inf")).bfloat16()
    temp = torch.tensor([0.0, 0.5, 1.0, 2.0])[torch.randint(4, (B,), generator=rng)]
    seeds, counters = torch.randint(0, 10**6, (B,), generator=rng), torch.randint(0, 10**4, (B,), generator=rng)
    flat = B * N1
    probs = logits_to_probs(logits.view(flat, V), temp.repeat_interleave(N1), torch.zeros(flat, dtype=torch.long),
                            torch.ones(flat), filters=False).view(B, N1, V)
    want = accept_tree_reference(probs, nodes, tree, seeds, counters, race=(logits, temp))
    on = [x.to(DEV) for x in (logits, temp, nodes)]
    for triton in (False, True):  # every pass in torch ops, or the Triton passes (`eyas.kernels.race`)
        got = accept_tree_logits(*on, dev_tree or tree.to(DEV), seeds.to(DEV), counters.to(DEV), use_triton=triton)
        for w, g, name in zip(want, got, ("path", "num_accepted", "bonus")):
            assert torch.equal(w, g.cpu()), (triton, name, temp, w, g)
    # the rounds and the walk in one launch (`eyas.kernels.accept_sampled`), and the packed output the host reads:
    # (num_accepted, the path's tokens, bonus)
    from eyas.kernels.accept_sampled import accept_tree_logits_triton
    fused = accept_tree_logits_triton(*on, dev_tree or tree.to(DEV), seeds.to(DEV), counters.to(DEV))
    for w, g, name in zip(want, fused, ("path", "num_accepted", "bonus")):
        assert torch.equal(w, g.cpu()), ("fused", name, temp, w, g)
    if N1 > 1:
        path, m, bonus = want
        packed = torch.cat([m[:, None], nodes.gather(1, path.clamp(min=0)), bonus[:, None]], 1)
        assert torch.equal(fused[3].cpu(), packed)
    return want[1]


# 40 examples (80 until session 65, 86 s of a cold CI run): the rounds from the logits are the path of
# `eyas.spec.step.COUPLED = False` since session 64; the tests beside this one keep its presets and filters
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 6), st.booleans(), st.booleans(), st.integers(0, 10**6))
def test_the_logits_sampler_equals_the_walk(max_nodes, max_width, B, repeats, filtered, seed):
    """Unfiltered (`check_logits_sampler`) or with top-k, top-p and min-p (`check_filtered_sampler`)."""
    check = check_filtered_sampler if filtered else check_logits_sampler
    check(*random_case(max_nodes, max_width, B, repeats, seed, liked=True))


def test_the_logits_sampler_equals_the_walk_on_the_presets_and_dynamic_trees():
    rng = torch.Generator().manual_seed(1)
    deepest = {}
    for name in ("chain:0", "chain:3", "tree:8", "tree:smollm2_48d5"):
        tree = resolve_tree(name) if name != "chain:0" else Tree.chain(0)
        nodes, target = case(tree, 32, rng)
        deepest[name] = int(check_logits_sampler(tree, nodes, target, rng).max())
    assert deepest["tree:smollm2_48d5"] >= 3 and deepest["chain:3"] == 3
    trees = [t for t in (random_tree(rng, 12, 3) for _ in range(40)) if t.num_nodes == 12][:4]
    rows = [case(t, 1, rng) for t in trees]
    check_logits_sampler(step_tree_of(trees), torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), rng,
                         step_tree_of([t.to(DEV) for t in trees]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.sampled_from([7, 2048, 4100]), st.integers(0, 3), st.booleans(), st.integers(0, 10**6))
def test_triton_race_and_row_stats_equal_their_references(R, vocab, W, picked_rows, seed):
    """`race_sample_triton` == `race_sample` and `row_stats_triton` == `row_stats`: one chunk, exactly one, and
    several with a partial last one; greedy rows; -inf tokens; excluded tokens (the max among them too, and
    repeats); the race's rows picked out of a larger logits tensor as a step's stop nodes are."""
    from eyas.kernels.race import race_sample_triton, row_stats_triton
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R + 2, vocab, generator=g) * 3).masked_fill(
        torch.rand(R + 2, vocab, generator=g) < 0.1, float("-inf")).bfloat16()
    rows = torch.randperm(R + 2, generator=g)[:R] if picked_rows else torch.arange(R)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.5])[torch.randint(4, (R,), generator=g)]
    seeds = torch.randint(-2**62, 2**62, (R,), generator=g)
    counters, base = torch.randint(0, 2**20, (R,), generator=g), torch.randint(0, 2**41, (R,), generator=g)
    exclude = torch.randint(-1, vocab, (R, W), generator=g)
    if W:
        exclude[:, 0] = logits[rows].float().argmax(-1)
    want = race_sample(logits[rows], temp, seeds, counters, base, exclude if W else None)
    args = [x.to(DEV) for x in (logits, temp, seeds, counters, base)]
    got = race_sample_triton(*args, exclude.to(DEV) if W else None, rows=rows.to(DEV) if picked_rows else None)
    assert torch.equal(got.cpu(), want)
    if W:
        assert not (want[:, None] == exclude).any()
    M, Z, top = row_stats(logits[rows], temp)
    tM, tZ, ttop = (x.cpu() for x in row_stats_triton(logits[rows].to(DEV), temp.to(DEV)))
    assert torch.equal(ttop, top) and torch.equal(tM, M)
    torch.testing.assert_close(tZ, Z, rtol=1e-5, atol=0)


def check_replay(tree: Tree, B: int, seed: int, R: int) -> torch.Tensor:
    """`replay_accept_triton` (one launch) == `simulate_replay` (its torch reference): path, count, bonus, and the
    packed output the host reads. Rows often start with a node's rank path (deep acceptance); R < the tree's depth
    (a shorter recording) matches nothing past R."""
    from eyas.kernels.accept_greedy import replay_accept_triton
    from eyas.spec.tree_builder import MISS
    from eyas.spec.verifier import simulate_replay
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 50, (1,), generator=g))
    ranks = torch.randint(0, 3, (T, R), generator=g)
    on_tree = [p for p in tree.paths if len(p) <= R]
    for t in range(T):  # most rows start with a random node's rank path
        if on_tree and torch.rand(1, generator=g) < 0.7:
            p = on_tree[int(torch.randint(len(on_tree), (1,), generator=g))]
            ranks[t, :len(p)] = torch.tensor(p)
    ranks[torch.rand(T, R, generator=g) < 0.1] = MISS
    # seeds as requests carry them (any int64, negative ones too)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=g)
    seeds[0] = 0
    counters = torch.randint(0, 10**6, (B,), generator=g)
    nodes = draft_tokens(tree, B, g)
    target = torch.randint(V, (B, tree.num_nodes + 1), generator=g)
    want = simulate_replay(nodes, tree, ranks, seeds, counters, target)
    *got, packed = replay_accept_triton(ranks.to(DEV), seeds.to(DEV), counters.to(DEV), target.to(DEV),
                                        nodes.to(DEV), tree.to(DEV))
    for w, x, name in zip(want, got, ("path", "num_accepted", "bonus")):
        assert torch.equal(w, x.cpu()), (name, w, x)
    path_tokens = nodes.gather(1, want[0].clamp(min=0))
    assert torch.equal(packed.cpu(), torch.cat([want[1][:, None], path_tokens, want[2][:, None]], 1))
    return want[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.integers(0, 10**6))
def test_triton_replayed_acceptance_equals_its_reference(max_nodes, max_width, B, R, seed):
    check_replay(random_tree(torch.Generator().manual_seed(seed), max_nodes, max_width), B, seed, R)


def test_triton_replayed_acceptance_on_the_presets():
    """A chain (the 8B shape's `chain:3` rows replay through it), the default tree and the largest fitted one; the
    accepted depths seen cover empty and deep acceptance."""
    seen = set()
    for i, (tree, R) in enumerate(((Tree.chain(3), 5), (Tree.from_paths(PRESETS["smollm2_48d5"], "48d5"), 5),
                                   (Tree.from_paths(PRESETS["smollm2_128"], "128"), 8))):
        for seed in range(3):
            seen |= set(check_replay(tree, 8, 300 * i + seed, R).tolist())
    assert 0 in seen and max(seen) >= 3, seen
