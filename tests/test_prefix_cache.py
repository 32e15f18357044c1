"""Prefix caching (eyas.cache.prefix_cache): a prompt that begins with cached blocks prefills only the rest, every
cache (target KV, draft KV, the draft's pending features) still holds exactly the committed history, outputs and
acceptance equal an engine without it, and no block leaks."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas import LLM, SamplingParams
from eyas.cache.block_manager import BlockManager
from helpers import assert_draft_state, dense_kv, paged_kv, write_mirror_pair, write_random_draft

BS = 4  # block size of the engine tests


@pytest.fixture(scope="module")
def mirror_pair(tmp_path_factory):
    """A draft that copies its target (long accepted paths), but reads only the token embeddings."""
    return write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)


@pytest.fixture(scope="module")
def random_pair(mirror_pair, tmp_path_factory):
    """The same target with a random draft, whose every output depends on the features it reads."""
    return mirror_pair[0], write_random_draft(tmp_path_factory.mktemp("random"), mirror_pair[0])


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 24, (n,), generator=g).tolist()


# ---- the pool --------------------------------------------------------------------------------------------------


def test_cached_blocks_are_parked_shared_and_evicted_oldest_first():
    bm = BlockManager(6, 4, prefix_caching=True)  # 5 usable
    a, b = [], []
    bm.reserve(a, 12)  # 3 blocks
    first = bm.prefix.insert(a[0], 0, (1, 2, 3, 4, 5))
    second = bm.prefix.insert(a[1], first, (5, 6, 7, 8, 9))
    assert bm.prefix.insert(a[2], 0, (1, 2, 3, 4, 5)) == first  # the key is taken: a[2] stays uncached
    held = list(a)
    bm.release(a)
    assert bm.num_free == 5 and len(bm.free) == 3 and list(bm.prefix.parked) == [held[1], held[0]]
    bm.share([held[0]])  # a new sequence takes the first cached block
    assert bm.num_free == 4 and bm.num_parked([held[0], held[1]]) == 1
    bm.reserve(b, 4 * 4)  # 4 blocks: the 3 free ones, then the parked block 1 (evicted, its entry forgotten)
    assert held[1] in b and len(bm.prefix) == 1 and bm.prefix.lookup(first, (5, 6, 7, 8, 9)) is None
    assert bm.prefix.lookup(0, (1, 2, 3, 4, 5)) == (first, held[0])
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.reserve(b, 4 * 5)
    bm.release(b)
    bm.release([held[0]])
    assert bm.num_used == 0 and second != first


def test_an_evicted_blocks_successors_are_never_found_again():
    """Block ids are reused after eviction; entry ids are not, so a successor keyed by an evicted entry cannot be
    found behind whatever the block holds next."""
    bm = BlockManager(3, 2, prefix_caching=True)  # 2 usable
    t = []
    bm.reserve(t, 4)
    x, y = t
    e1 = bm.prefix.insert(x, 0, (1, 2, 3))
    bm.prefix.insert(y, e1, (3, 4, 5))
    bm.release(t)  # parks y, then x
    u = []
    bm.reserve(u, 2)  # evicts y (parked first)
    assert u == [y]
    e1b = bm.prefix.insert(y, 0, (1, 2, 3))  # not found: x holds it
    assert e1b == e1
    v = []
    bm.reserve(v, 2)  # evicts x: the entry (0, (1, 2, 3)) is gone
    assert v == [x] and bm.prefix.lookup(0, (1, 2, 3)) is None
    e1c = bm.prefix.insert(x, 0, (1, 2, 3))  # x cached again, under a new entry id
    assert e1c != e1 and bm.prefix.lookup(e1c, (3, 4, 5)) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "release", "cache"]), st.integers(0, 7), st.integers(1, 9)),
                max_size=60))
def test_pool_accounting_holds_under_any_order(ops):
    """Every block is in exactly one place (free, parked, or held by the tables that hold it, counted in `refs`)."""
    bm = BlockManager(9, 2, prefix_caching=True)
    tables: list[tuple[list[int], list[int]]] = []  # (blocks, tokens written)
    for op, i, n in ops:
        if op == "new":  # a sequence: the cached prefix of its tokens, then fresh blocks
            toks = [i % 3] * (2 * n + 1)
            blocks, parent = [], 0
            for b in range(n):
                found = bm.prefix.lookup(parent, tuple(toks[2 * b: 2 * b + 3]))
                if found is None:
                    break
                parent, blk = found
                blocks.append(blk)
            if bm.blocks_needed(blocks, 2 * n) + bm.num_parked(blocks) > bm.num_free:
                continue
            bm.share(blocks)
            bm.reserve(blocks, 2 * n)
            tables.append((blocks, toks))
        elif tables and op == "release":
            blocks, _ = tables.pop(i % len(tables))
            bm.release(blocks)
        elif tables and op == "cache":
            blocks, toks = tables[i % len(tables)]
            parent = 0
            for b, blk in enumerate(blocks):
                parent = bm.prefix.insert(blk, parent, tuple(toks[2 * b: 2 * b + 3]))
        held = [blk for blocks, _ in tables for blk in blocks]
        parked = list(bm.prefix.parked)
        assert sorted(list(bm.free) + parked + sorted(set(held))) == list(range(1, 9))
        assert all(bm.refs[blk] == held.count(blk) for blk in range(1, 9))
        assert all(bm.prefix.holds(blk) for blk in parked) and not any(bm.prefix.holds(blk) for blk in bm.free)
    for blocks, _ in tables:
        bm.release(blocks)
    assert bm.num_used == 0


# ---- the engine ------------------------------------------------------------------------------------------------


def _assert_caches_exact(llm, seq):
    """The target KV, the draft KV and the pending features of a running `seq` against dense forwards."""
    engine, target = llm.engine, llm.target
    n = seq.num_cached
    ids, pos = torch.tensor([seq.token_ids[:n]]), torch.arange(n)[None]
    hidden = {}

    def run_target():
        hidden["h"] = target(ids, pos)
        return pos

    for layer, (k, v) in enumerate(dense_kv(target.model.layers, target.rope, run_target)):
        pk, pv = paged_kv(engine.runner.cache, layer, seq.block_table, n, BS)
        torch.testing.assert_close(pk, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pv, v, atol=1e-5, rtol=1e-5)
    if llm.draft is not None:
        assert_draft_state(engine, seq, target, llm.draft, hidden["h"], BS)


@pytest.mark.parametrize("pair", ["mirror_pair", "random_pair"])
@pytest.mark.parametrize("spec", ["chain:4", "tree:mc_sim_7b_63"])
def test_a_hit_holds_exactly_the_committed_history(request, pair, spec):
    """Prompts that share a cached prefix take its blocks, up to the last block whose next token they share too
    (the draft's KV at a block's last position read that token), and their caches are exact afterwards."""
    target_dir, draft_dir = request.getfixturevalue(pair)
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation=spec,
              block_size=BS)
    engine = llm.engine
    base = _ids(11, 1)
    llm.generate([base], SamplingParams(max_tokens=6, ignore_eos=True))  # caches blocks 0 and 1 (keys to token 8)
    same_to_8 = base[:9] + _ids(5, 2)  # shares tokens 0..8: both blocks
    other_8 = base[:8] + [(base[8] + 1) % 24] + _ids(5, 3)  # shares 0..7: block 1's next token differs
    other_4 = base[:4] + [(base[4] + 1) % 24] + _ids(9, 4)  # block 0's next token differs: nothing
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in (same_to_8, other_8, other_4)]
    engine.step()  # the prefill step
    assert [s.prefix_hit for s in seqs] == [8, 4, 0]
    assert engine.scheduler.prefix_hits == 12
    for _ in range(6):
        engine.step()
    for s in seqs:
        assert not s.finished and s.stats.target_calls > 0
        _assert_caches_exact(llm, s)
    for s in seqs:
        engine.abort(s.request_id)
    assert engine.blocks.num_used == 0


def test_draftless_steps_leave_their_blocks_out_of_the_cache(mirror_pair):
    """A request hot enough never to speculate (bands that end in plain decoding) decodes without the draft, whose
    KV of the positions it generates is then never written: none of those blocks is offered to the prefix cache. A
    later turn that starts with the prompt and that answer takes the prompt's blocks only, and its caches, the
    draft's included, are exact."""
    target_dir, draft_dir = mirror_pair
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation="chain:4|0.9=plain",
              block_size=BS)
    engine = llm.engine
    base = _ids(11, 1)
    hot = llm.generate([base], SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True))[0]
    assert engine.runner.tree_steps.get("plain", 0) > 0
    seq = engine.add_request(base + hot.token_ids + _ids(5, 2), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # the prefill step
    assert seq.prefix_hit == 8  # blocks 0 and 1: the draft read the prompt's pairs up to position 9
    for _ in range(4):
        engine.step()
    assert not seq.finished
    _assert_caches_exact(llm, seq)
    engine.abort(seq.request_id)
    assert engine.blocks.num_used == 0


def _workload():
    """Prompts sharing a 14-token system prefix, then second turns (a prompt, its answer and more)."""
    system = _ids(14, 5)
    first = [system + _ids(n, 6 + n) for n in (3, 6, 9)]
    return system, first


@pytest.mark.parametrize("pair,spec", [("mirror_pair", None), ("mirror_pair", "chain:4"),
                                       ("mirror_pair", "tree:mc_sim_7b_63"), ("mirror_pair", "dyn:k3d4n8"),
                                       ("random_pair", "chain:4"), ("random_pair", "tree:mc_sim_7b_63")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_and_acceptance_equal_an_engine_without_it(request, pair, spec, temperature):
    target_dir, draft_dir = request.getfixturevalue(pair)
    kw = dict(device="cpu", dtype="float32", block_size=BS)
    if spec is not None:
        kw.update(draft=str(draft_dir), speculation=spec)
    system, first = _workload()
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=11, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        llm = LLM(str(target_dir), prefix_caching=caching, **kw)
        outs = llm.generate(first, params)
        turn2 = [p + o.token_ids + _ids(5, 20 + i) for i, (p, o) in enumerate(zip(first, outs))]
        outs += llm.generate(turn2 + [system + _ids(4, 30)], params)
        runs[caching] = [(o.token_ids, o.stats.committed, o.stats.target_calls, o.stats.accepted_by_depth)
                         for o in outs]
        assert llm.engine.blocks.num_used == 0
        if caching:
            hits = [o.num_cached_tokens for o in outs]
            assert hits[:3] == [0, 0, 0] and all(h >= 12 for h in hits[3:]), hits
            assert hits[3] >= len(first[0]) + 20 - BS  # the second turn's hit reaches into the first answer
    assert runs[True] == runs[False]


@pytest.mark.parametrize("spec", [None, "tree:mc_sim_7b_63"])
def test_requests_that_arrive_together_wait_for_a_long_shared_prefix(mirror_pair, spec):
    """Three choices of one 101-token prompt, then three prompts on a 90-token system prompt (and, second, one whose
    65th token differs from it), and one that shares only 40 of it, all at once. The first of each group computes
    the shared blocks; the others wait a prefill step (they would gain >= SHARE_MIN_TOKENS = 64) and take them all;
    the two others would gain too little to wait for (the one that differs at token 65 shares 64 tokens but only 15
    whole blocks' keys), and take what is cached when their turn comes. Outputs equal an engine without prefix
    caching; no block leaks."""
    from eyas.engine.scheduler import SHARE_MIN_TOKENS
    assert SHARE_MIN_TOKENS == 64
    target_dir, draft_dir = mirror_pair
    kw = dict(device="cpu", dtype="float32", block_size=BS)
    if spec is not None:
        kw.update(draft=str(draft_dir), speculation=spec)
    system = _ids(90, 40)
    other = system[:64] + [(system[64] + 1) % 24] + _ids(20, 51)  # 64 alike, but a block's key holds the token after
    prompts = ([_ids(101, 41)] * 3 + [system + _ids(7, 42)] + [other] + [system + _ids(7, 43 + i) for i in range(2)]
               + [system[:40] + _ids(9, 50)])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = LLM(str(target_dir), prefix_caching=False, **kw).generate(prompts, params)
    llm = LLM(str(target_dir), **kw)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # 100 = the prompt's whole blocks (one token is always prefilled); 88 = the system prompt's whole blocks whose
    # next token is the system prompt's too; 36: the block that holds token 40 has a different next token
    assert [o.num_cached_tokens for o in outs] == [0, 100, 100, 0, 0, 88, 88, 36]
    assert llm.engine.blocks.num_used == 0


@pytest.mark.parametrize("spec", [None, "tree:mc_sim_7b_63"])
def test_preemption_with_shared_blocks_loses_nothing(mirror_pair, spec):
    """A pool too small for the batch: sequences that share cached blocks are preempted and come back through the
    cache; outputs equal a roomy engine's without prefix caching, and every block comes back."""
    target_dir, draft_dir = mirror_pair
    kw = dict(device="cpu", dtype="float32", block_size=BS)
    if spec is not None:
        kw.update(draft=str(draft_dir), speculation=spec)
    system, _ = _workload()
    prompts = [system + _ids(n, 40 + n) for n in range(1, 7)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(target_dir), prefix_caching=False, **kw).generate(prompts, params)]
    small = LLM(str(target_dir), num_blocks=30, **kw)
    assert [o.token_ids for o in small.generate(prompts, params)] == ref
    sched = small.engine.scheduler
    assert sched.num_preemptions > 0 and sched.prefix_hits > 0
    assert small.engine.blocks.num_used == 0


@pytest.mark.parametrize("pair", [None, "mirror_pair"])
def test_a_prompts_last_block_is_cached_with_the_token_after_it(request, mirror_pair, pair):
    """A prompt of whole blocks: its last block's key needs the first output token, so that block is cached when
    the request lets it go, and a second turn that starts with the prompt and that token takes every block."""
    kw = dict(device="cpu", dtype="float32", block_size=BS)
    if pair is not None:
        kw.update(draft=str(request.getfixturevalue(pair)[1]), speculation="chain:4")
    llm = LLM(str(mirror_pair[0]), **kw)
    prompt = _ids(2 * BS, 50)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    again = llm.generate([prompt + out.token_ids[:3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert again.num_cached_tokens == 2 * BS


def test_a_waiting_requests_lookup_is_redone_once_the_cache_changes():
    """A request that cannot be admitted is looked up at every step; the lookup is kept until an entry is made or
    evicted, and then found anew."""
    from eyas.engine.scheduler import Scheduler
    from eyas.engine.sequence import Sequence
    bm = BlockManager(8, 2, prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, lookahead=1, with_draft=True)
    seq = Sequence([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2), 0)
    assert sched._prefix_hit(seq) == ([], [])
    held = []
    bm.reserve(held, 4)
    e = bm.prefix.insert(held[0], 0, (1, 2, 3))
    assert sched._prefix_hit(seq) == ([held[0]], [e])  # found once the cache changed
    bm.prefix.insert(held[1], e, (3, 4, 5))
    assert sched._prefix_hit(seq) == (held, [e, e + 1])
    bm.release(held)
    other = []
    bm.reserve(other, 14)  # every block: both cached ones evicted
    assert sched._prefix_hit(seq) == ([], [])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spec", [None, "chain:4", "tree:mc_sim_7b_63"])
def test_random_workloads_with_aborts_and_preemption(mirror_pair, reference, spec, seed):
    """Eight requests over three shared prefixes arrive at random steps into a pool too small for them all, and a
    quarter of them are aborted mid-way: every request that ran to its end gave what it gives alone on a roomy
    engine without the cache, and the pool's accounting holds (nothing held at the end, parked blocks all cached)."""
    import random
    rng = random.Random(seed)
    target_dir, draft_dir = mirror_pair
    kw = dict(device="cpu", dtype="float32", block_size=BS)
    if spec is not None:
        kw.update(draft=str(draft_dir), speculation=spec)
    prefixes = [_ids(9, 60), _ids(13, 61), _ids(6, 62)]
    prompts = [rng.choice(prefixes) + _ids(rng.randint(1, 9), 70 + 10 * seed + i) for i in range(8)]
    arrivals = sorted(rng.randint(0, 8) for _ in range(8))
    aborted = set(rng.sample(range(8), 2))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = reference(tuple(map(tuple, prompts)))
    llm = LLM(str(target_dir), num_blocks=18, max_num_seqs=4, **kw)
    engine = llm.engine
    seqs, step = {}, 0
    while len(seqs) < 8 or engine.has_unfinished():
        for i in range(len(seqs), 8):
            if arrivals[i] <= step:
                seqs[i] = engine.add_request(prompts[i], params)
        for i in aborted & set(seqs):  # two steps after arrival, while it prefills or decodes
            if not seqs[i].finished and step == arrivals[i] + 2:
                engine.abort(seqs[i].request_id)
        engine.step()
        step += 1
        assert step < 400
    for i, s in seqs.items():
        if s.finish_reason != "abort":
            assert s.output_ids == ref[i], i
    assert engine.scheduler.prefix_hits > 0
    bm = engine.blocks
    assert bm.num_used == 0 and all(r == 0 for r in bm.refs) and all(bm.prefix.holds(b) for b in bm.prefix.parked)


@pytest.fixture(scope="module")
def reference(mirror_pair):
    """prompts -> each one's 12 greedy tokens, alone, on a plain engine without the cache (memoised; a pool of 64
    blocks, not the default gigabyte, as the fixture lives as long as the module's tests)."""
    llm, memo = LLM(str(mirror_pair[0]), device="cpu", dtype="float32", prefix_caching=False, num_blocks=64), {}

    def run(prompts: tuple) -> list[list[int]]:
        for p in prompts:
            if p not in memo:
                memo[p] = llm.generate([list(p)], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
        return [memo[p] for p in prompts]

    return run


def test_reset_forgets_every_cached_block_and_the_running_cache_theirs_again(mirror_pair):
    """`Scheduler.reset_prefix_cache`: parked blocks become free ones, nothing is found until blocks are cached
    again, and a request running through the reset caches its blocks anew (from its first) when it ends."""
    target_dir, draft_dir = mirror_pair
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation="chain:4",
              block_size=BS)
    engine, prompt = llm.engine, _ids(17, 90)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = llm.generate([prompt], params)[0]
    running = engine.add_request(prompt + [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert running.prefix_hit == 16
    bm = engine.blocks
    free = bm.num_free
    assert engine.scheduler.reset_prefix_cache() > 0
    assert len(bm.prefix) == 0 and not bm.prefix.parked and bm.num_free == free
    from eyas.engine.sequence import Sequence
    assert engine.scheduler._prefix_hit(Sequence(list(prompt), params, 0)) == ([], [])  # nothing is found
    while engine.has_unfinished():
        engine.step()
    assert bm.num_used == 0
    again = llm.generate([prompt], params)[0]  # the running request cached its blocks again as it ended
    assert again.num_cached_tokens == 16 and again.token_ids == ref.token_ids
