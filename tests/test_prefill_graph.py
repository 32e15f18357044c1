"""The prefill's padded shapes and graphs (`eyas.engine.prefill_graph`). CPU: a padded prefill computes and writes what
a dense forward does, and an engine whose prefills are padded (the draft reading them after the step or inside it)
gives what one without gives, and leaves the same caches. GPU: a graph replays the eager step, to the bit."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.cache.kv_cache import KVCache
from eyas.engine.prefill_graph import (BATCH_BUCKETS, FIELDS, GRAPH_TOKENS, SMALL_GRAPH_TOKENS, TOKEN_BUCKETS,
                                       PrefillGraphs, graph_tokens, pack, prefill_forward, prefill_shape,
                                       prefill_step, unpack)
from eyas.loader.resolve import load_target
from helpers import dense_kv, paged_kv, write_mirror_and_random, write_mirror_pair, write_tiny_llama

BS = 4  # block size


@pytest.mark.parametrize("limit", [GRAPH_TOKENS, SMALL_GRAPH_TOKENS])
def test_prefill_shapes_pad_up_by_little(limit):
    for B in range(1, 20):
        last = 0
        for Q in range(1, 2100):
            s = prefill_shape(B, Q, limit)
            fits = [(b, q) for b in BATCH_BUCKETS for q in TOKEN_BUCKETS if b >= B and q >= Q and b * q <= limit]
            if s is None:
                assert not fits
                continue
            b, q = s
            assert (b, q) == min(fits)  # the smallest buckets that hold the chunk
            assert b * q <= limit and q >= last
            assert q - Q < 16 if Q <= 128 else (q - Q) / Q <= 0.25
            last = q
    assert prefill_shape(1, 2048, limit) == (1, 2048) and prefill_shape(1, 2049, limit) is None
    assert prefill_shape(17, 1, limit) is None
    top = 128 if limit == 2048 else 512  # the longest chunk a batch of 16 pads within the limit
    assert prefill_shape(16, top, limit) == (16, top) and prefill_shape(16, top + 1, limit) is None
    assert prefill_shape(9, 300, limit) == ((16, 320) if limit == 8192 else None)


def test_small_targets_graph_larger_prefill_chunks(monkeypatch):
    """`graph_tokens`: SMALL_GRAPH_TOKENS below SMALL_MODEL parameters, GRAPH_TOKENS from it on; a runner takes its
    target's."""
    import eyas.engine.prefill_graph as pg
    model = torch.nn.Linear(10, 10)  # 110 parameters
    assert graph_tokens(model) == SMALL_GRAPH_TOKENS
    monkeypatch.setattr(pg, "SMALL_MODEL", 110)
    assert graph_tokens(model) == GRAPH_TOKENS
    monkeypatch.setattr(pg, "SMALL_MODEL", 111)
    assert graph_tokens(model) == SMALL_GRAPH_TOKENS


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pack_lays_out_each_field_as_unpack_reads_it(data):
    """`pack`'s flat buffer, read through `unpack`: each sequence's tokens, start, length, slot, draft start, seed,
    temperature and block table in its row, zeros past them; padding rows with no tokens, an empty table, the
    scratch slot and temperature 0."""
    B = data.draw(st.sampled_from([1, 2, 4, 8]))
    Q, width = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 6))
    n = data.draw(st.integers(0, B))
    ints = st.integers(0, 2**40)
    rows = [data.draw(st.lists(ints, max_size=Q)) for _ in range(n)]
    tables = [data.draw(st.lists(ints, max_size=width)) for _ in range(n)]
    start, lens, slots, dstart, seeds = ([data.draw(ints) for _ in range(n)] for _ in range(5))
    temps = [data.draw(st.floats(0, 10)) for _ in range(n)]
    drafted, sampled = data.draw(st.booleans()), data.draw(st.booleans())
    packed = pack(rows, start, lens, tables, B, Q, width, slots if drafted else None, dstart if drafted else None,
                  pad_slot=99, seeds=seeds if sampled else None, temperatures=temps if sampled else None)
    assert packed.dtype == torch.long and packed.numel() == B * (Q + FIELDS + width)
    fields = unpack(packed, B, Q)
    assert fields[6].dtype == torch.float64
    ids, got_start, got_lens, got_slots, got_dstart, got_seeds, got_temps, got_tables = (x.tolist() for x in fields)
    pad = [[]] * (B - n)
    assert ids == [r + [0] * (Q - len(r)) for r in rows + pad]
    assert got_tables == [t + [0] * (width - len(t)) for t in tables + pad]
    assert (got_start, got_lens) == (start + [0] * (B - n), lens + [0] * (B - n))
    assert got_slots == (slots if drafted else []) + [99] * (B - (n if drafted else 0))
    assert got_dstart == (dstart if drafted else []) + [0] * (B - (n if drafted else 0))
    assert got_seeds == (seeds if sampled else []) + [0] * (B - (n if sampled else 0))
    assert got_temps == (temps if sampled else []) + [0.0] * (B - (n if sampled else 0))


def test_every_graph_writes_its_outputs_into_one_shared_buffer():
    """A graph's outputs are views of buffers every graph shares, made once: the hidden state's and the features'
    [B, Q, ...] (the runner's `prefill_tokens` rows each; one buffer when there are no features: both views are the
    same), the logits' [B, V] and the first tokens' [B] (the largest batch bucket's rows)."""
    from types import SimpleNamespace
    for features in (False, True):
        g = PrefillGraphs(runner=SimpleNamespace(prefill_tokens=GRAPH_TOKENS))
        h = torch.zeros(1, 16, 8, dtype=torch.bfloat16)
        like = (h, torch.zeros(1, 16, 24, dtype=torch.bfloat16) if features else h, torch.zeros(1, 40),
                torch.zeros(1, dtype=torch.long))
        a, b = g._outputs(like, 1, 16), g._outputs(like, 4, 32)
        assert [tuple(x.shape) for x in b] == [(4, 32, 8), (4, 32, 24 if features else 8), (4, 40), (4,)]
        assert (a[1] is a[0]) != features and b[0].dtype == torch.bfloat16 and b[2].dtype == torch.float32
        assert b[3].dtype == torch.long
        assert all(x.data_ptr() == y.data_ptr() for x, y in zip(a, b))  # the same memory, from its start
        assert [tuple(x.shape) for x in g._buffers] == \
            [(GRAPH_TOKENS, 8)] + [(GRAPH_TOKENS, 24)] * features + [(BATCH_BUCKETS[-1], 40), (BATCH_BUCKETS[-1],)]


def test_a_prefill_graph_that_fails_to_capture_leaves_its_shape_to_the_eager_step(caplog):
    """A capture that fails when a shape is first seen (a CUDA error is a RuntimeError) is logged and its key runs
    eagerly from then on (`run` returns None, and does not try again); other keys still capture and replay."""
    from types import SimpleNamespace
    g = PrefillGraphs(runner=SimpleNamespace(prefill_tokens=GRAPH_TOKENS))
    tries, replays = [], []

    class Graph:
        def replay(self):
            replays.append(1)

    def capture(key):
        tries.append(key)
        if key[0] == 2:
            raise torch.AcceleratorError("operation failed due to a previous error during capture")
        return Graph(), torch.zeros(3, dtype=torch.long), ("outputs",)
    g._capture = capture
    packed = torch.arange(3)
    with caplog.at_level("WARNING", logger="eyas"):
        assert g.run(packed, (2, 16, 0, False)) is None
        assert g.run(packed, (2, 16, 0, False)) is None
    assert tries == [(2, 16, 0, False)] and g.failed == {(2, 16, 0, False)} and not g.graphs
    assert "could not be captured" in caplog.text
    assert g.run(packed, (1, 16, 0, False)) == ("outputs",) and replays == [1]
    assert torch.equal(g.graphs[(1, 16, 0, False)][1], packed)  # the inputs copied in before the replay


def test_graphs_captured_ahead_serve_a_chats_next_turn_and_later_chunks(pairs, monkeypatch):
    """`capture_all` captures, ahead of time, the key of every padded chunk a server's engine runs: first chunks, a
    long prompt's later chunks, and a chat's next turn after a prefix-cache hit (`prefill_context`: one key for a
    prefix of any length), so that no request pays a capture in its path. The decode graphs' context buckets are
    made small here, so that a key following them would differ for short and long prefixes."""
    import eyas.engine.cuda_graph as cg
    import eyas.engine.prefill_graph as pg
    from eyas import LLM, SamplingParams
    monkeypatch.setattr(cg, "CONTEXT_BUCKETS", (64,))
    monkeypatch.setattr(pg, "DRAFT_IN_PREFILL", True)
    target, draft = pairs["random"]
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=24, max_num_seqs=4,
              draft=str(draft), speculation="chain:4")
    r = llm.engine.runner
    r.pad_prefill = True
    r.prefill_tokens = 64  # chunks of more padded tokens run at their own shape: no graph is captured for them
    graphs = pg.PrefillGraphs(r)
    ahead, seen = [], []
    graphs._capture = lambda key: ahead.append(key) or (None, None, None)
    graphs.capture_all(4, 24)
    graphs.graphs.clear()
    graphs.run = lambda packed, key: seen.append(key)  # (None: the step runs eagerly, at the same shape)
    r.prefill_graphs = graphs
    g = torch.Generator().manual_seed(5)
    first = [torch.randint(1, 24, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(first, params)
    outs += llm.generate([p + o.token_ids + [5, 6, 7] for p, o in zip(first, outs)], params)
    assert sum(o.num_cached_tokens for o in outs[4:]) > 0  # the second turn found its prefix
    width = r.width * BS
    assert {k[2] for k in seen} == {0, width} and width > 64  # first chunks, and chunks after a prefix
    assert set(seen) <= set(ahead), set(seen) - set(ahead)
    assert len(ahead) == len(set(ahead)) == 2 * len({k for k in ahead if k[2] == 0})
    assert all(b * q <= 64 for b, q, *_ in ahead) and (4, 16, 0, True) in ahead


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target, _ = load_target(str(write_tiny_llama(tmp_path_factory.mktemp("t"), layers=2, vocab=40)), "cpu",
                            "float32")
    return target


def target_inputs(packed, B, Q):
    """(ids, start, lens, block tables) of `pack`'s layout: what `prefill_forward` takes."""
    ids, start, lens, _, _, _, _, tables = unpack(packed, B, Q)
    return ids, start, lens, tables


def dense(target, ids):
    """(hidden [n, H], per-layer (K, V) [n, ...]) of a plain causal forward over one sequence's tokens."""
    box = {}

    def run():
        pos = torch.arange(len(ids))[None]
        box["h"] = target(torch.tensor([ids]), pos)[0]
        return pos
    with torch.no_grad():
        kv = dense_kv(target.model.layers, target.rope, run)
    return box["h"], kv


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU tensors: under the interpreter"))])
def test_a_padded_prefill_computes_and_writes_what_a_dense_forward_does(tiny, triton):
    """Two sequences, one with a prefix already cached by an earlier chunk, prefilled at a padded shape (more rows
    and more tokens than they have, tables as wide as a graph's): the hidden states of their tokens and every cache
    entry equal a dense forward's, and the padding writes nowhere but the scratch block 0. On the reference
    attention and on the Triton kernels (interpreted on the CPU)."""
    cfg = tiny.config
    cache = KVCache.allocate(cfg, cfg.num_hidden_layers, 12, BS, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 40, (13,), generator=g).tolist()  # 5 tokens cached by a first chunk, then 8
    b = torch.randint(1, 40, (3,), generator=g).tolist()
    tables = [[3, 7, 1, 9], [5]]
    with torch.no_grad():
        first = pack([a[:5]], [0], [5], tables[:1], 1, 5, 4)  # the first chunk at its own shape
        prefill_forward(tiny, cache, *target_inputs(first, 1, 5), BS, 0, triton)
        packed = pack([a[5:], b], [5, 0], [8, 3], tables, 4, 16, 6)  # 2 padded rows, 8 padded tokens, wide tables
        hidden, feats = prefill_forward(tiny, cache, *target_inputs(packed, 4, 16), BS, 16, triton)
    assert hidden.shape[:2] == (4, 16) and feats is hidden
    for row, (seq, start, table) in enumerate(((a, 5, tables[0]), (b, 0, tables[1]))):
        h, kv = dense(tiny, seq)
        torch.testing.assert_close(hidden[row, : len(seq) - start], h[start:], atol=1e-5, rtol=1e-5)
        for layer, (k, v) in enumerate(kv):
            ck, cv = paged_kv(cache, layer, table, len(seq), BS)
            torch.testing.assert_close(ck, k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cv, v, atol=1e-5, rtol=1e-5)
    used = {0, 3, 7, 1, 9, 5}  # 0: the scratch block; a's 13 tokens fill 3, 7 and 1 and one entry of 9
    for blk in set(range(12)) - used:
        assert not cache.k[:, blk].any() and not cache.v[:, blk].any(), blk
    assert not cache.k[:, 9, 1:].any()  # past a's last token in its last block


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_mirror_and_random(tmp_path_factory)


# the mirror draft accepts long paths but reads only token embeddings; the random one reads the features it is given
@pytest.mark.parametrize("pair,spec", [("mirror", None), ("mirror", "tree:mc_sim_7b_63"), ("random", "chain:4")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("in_step", [False, True])
def test_an_engine_that_pads_its_prefills_gives_what_one_that_does_not_gives(pairs, pair, spec, temperature, in_step,
                                                                            monkeypatch):
    """The runner's padded prefills (`pad_prefill`, a GPU's default) through the whole engine, on the CPU: prompts of
    several lengths prefilled together and in chunks, a second turn on the prefix cache, prompt and output
    log-probabilities, the draft reading the padded features on the device (`draft_read`). Tokens, acceptance and
    step counts equal an engine that prefills at the chunks' own shapes, log-probabilities within float32 rounding;
    no block leaks."""
    import eyas.engine.prefill_graph as pg
    from eyas import LLM, SamplingParams
    monkeypatch.setattr(pg, "DRAFT_IN_PREFILL", in_step)  # the draft reads the chunk in the step, or after it
    target, draft = pairs[pair]
    kw = dict(device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=24)
    if spec is not None:
        kw.update(draft=str(draft), speculation=spec)
    g = torch.Generator().manual_seed(2)
    first = [torch.randint(1, 24, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    # the last request, whose prompt ends alone in a padded step, filters its tokens or biases its logits (half the
    # cases each): the first token is then drawn on the host (`ModelRunner._first_tokens`), not by the step
    extra = [{}, {}, {}, dict(top_k=1) if in_step else dict(logit_bias={5: 8.0})]
    params = [SamplingParams(temperature=temperature, max_tokens=12, seed=i, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2 if i % 2 else None, **extra[i]) for i in range(4)]
    runs, padded_steps, drafted, over_limit, stepped = {}, [], [], [], []
    for pad in (False, True):
        llm = LLM(str(target), **kw)
        runner = llm.engine.runner
        runner.pad_prefill = pad
        assert runner.prefill_tokens == SMALL_GRAPH_TOKENS  # (`graph_tokens` of a tiny target)
        runner.prefill_tokens = 32  # chunks of more padded tokens run at their own shape
        orig = runner._prefill_forward

        def note(seqs, lens, _orig=orig):
            out = _orig(seqs, lens)  # (hidden, features, logits, first tokens, whether the draft read the chunk)
            own = (len(seqs), max(lens))
            padded_steps.append(pad and tuple(out[0].shape[:2]) != own)
            if pad:
                assert tuple(out[0].shape[:2]) == (prefill_shape(*own, 32) or own)
                over_limit.append(prefill_shape(*own, 32) is None and prefill_shape(*own, 64) not in (None, own))
            assert out[2].shape[0] == out[0].shape[0]  # the logits of every row, padding rows' too
            # the padded steps draw the first tokens (`first_tokens`), the others leave them to the host
            assert (out[3] is not None) == (pad and prefill_shape(*own, 32) is not None)
            stepped.append(out[3] is not None)
            drafted.append(out[4])
            return out
        runner._prefill_forward = note
        outs = llm.generate(first, params)
        turn2 = [p + o.token_ids + [5, 6, 7] for p, o in zip(first, outs)]
        outs += llm.generate(turn2, params)
        assert llm.engine.blocks.num_used == 0
        assert sum(o.num_cached_tokens for o in outs[4:]) > 0  # the second turn found its prefix
        runs[pad] = outs
    assert any(padded_steps) and any(over_limit)  # chunks padded, and some left at their own shape by the limit
    assert any(stepped)
    assert any(drafted) == (spec is not None and in_step)  # the padded steps' draft read the chunks (`draft_read`)
    for a, b in zip(runs[False], runs[True]):
        assert (a.token_ids, a.stats.committed, a.stats.target_calls, a.stats.accepted_by_depth) == \
            (b.token_ids, b.stats.committed, b.stats.target_calls, b.stats.accepted_by_depth)
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for x, y in zip(a.logprobs + (a.prompt_logprobs or []), b.logprobs + (b.prompt_logprobs or [])):
            assert (x is None) == (y is None)  # (a prompt's first token has no entry)
            if x is not None:
                assert [t for t, _ in x.top] == [t for t, _ in y.top] and x.rank == y.rank
                assert abs(x.logprob - y.logprob) < 1e-4
                assert all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x.top, y.top))


@pytest.mark.parametrize("pair", ["mirror", "random"])
@pytest.mark.parametrize("in_step", [False, True])
def test_padded_prefills_leave_the_caches_and_waiting_features_an_unpadded_one_leaves(pairs, pair, in_step,
                                                                                     monkeypatch):
    """Prefill alone (one token each), prompts prefilled together and in chunks: the target's and the draft's caches
    and the draft's waiting features after padded prefills (`pad_prefill`, the draft reading them on the device)
    equal those after prefills at the chunks' own shapes, within float32 rounding."""
    import eyas.engine.prefill_graph as pg
    from eyas import LLM, SamplingParams
    monkeypatch.setattr(pg, "DRAFT_IN_PREFILL", in_step)
    target, draft = pairs[pair]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 24, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 45)]
    state = {}
    for pad in (False, True):
        llm = LLM(str(target), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=24,
                  draft=str(draft), speculation="chain:4", prefix_caching=False)
        r = llm.engine.runner
        r.pad_prefill = pad
        for t in (r.cache.k, r.cache.v, r.draft_cache.k, r.draft_cache.v, r.draft_hidden):
            t.zero_()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        # block 0 is the scratch block, the last slot the scratch slot: padding writes there
        state[pad] = [r.cache.k[:, 1:], r.cache.v[:, 1:], r.draft_cache.k[:, 1:], r.draft_cache.v[:, 1:],
                      r.draft_hidden[:-1, 0]]
    for a, b in zip(state[False], state[True]):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _where(x, y):
    """Where two tensors differ (a failure's message): how many elements, and the first indices."""
    diff = (x != y).nonzero()
    return f"{len(diff)} differ, first at {diff[:4].tolist()}"


@gpu
@pytest.mark.parametrize("draft", [None, "eagle1", "features"])
def test_the_prefill_graph_replays_the_eager_step(tmp_path, draft, monkeypatch):
    """Graphed and eager prefill steps (the Triton kernels, bf16) give the same hidden states, features, target
    cache and, with a draft, the same draft cache and waiting features, to the bit: chunks of several shapes (a first
    chunk, a batch of a later chunk and a first one, a longer one) replayed from graphs captured on padding alone."""
    import eyas.engine.prefill_graph as pg
    from eyas.engine.runner import ModelRunner
    from eyas.loader.eagle import load_draft
    from helpers import feature_draft_from
    target_dir, draft_dir = write_mirror_pair(tmp_path / "m", vocab=24, layers=2)
    target, _ = load_target(str(target_dir), "cuda", "bfloat16")
    d = None
    if draft is not None:
        if draft == "features":
            cpu_target, _ = load_target(str(target_dir), "cpu", "float32")
            draft_dir = feature_draft_from(draft_dir, cpu_target, tmp_path / "f", feature_layers=(0,), noise=0.5)
        d = load_draft(draft_dir, target, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(pg, "DRAFT_IN_PREFILL", True)  # (capture_all's graphs with the draft's reading)
    runner = ModelRunner(target, d, None, 16, BS, cuda_graphs=True, max_model_len=64, max_num_seqs=4)
    graphs = runner.prefill_graphs
    g = torch.Generator().manual_seed(1)
    cases = [  # (rows, starts, lens, draft starts, slots, tables, padded shape, context bound)
        ([torch.randint(1, 24, (9,), generator=g).tolist()], [0], [9], [0], [0], [[2, 4, 6]], (1, 16), 0),
        ([torch.randint(1, 24, (5,), generator=g).tolist(), [3, 1, 4]], [6, 0], [5, 3], [5, 0], [1, 2],
         [[2, 4, 6], [8]], (2, 16), runner.width * BS),
        ([torch.randint(1, 24, (20,), generator=g).tolist()], [0], [20], [0], [3], [[9, 10, 11, 12, 13]], (1, 32),
         0),
    ]
    # (draft_hidden's scratch row, num_slots, is left out: padding rows write it, and so does a capture's warm-up)
    state = [runner.cache.k, runner.cache.v] + ([runner.draft_cache.k, runner.draft_cache.v,
                                                  runner.draft_hidden[:runner.num_slots]] if d is not None else [])
    for t in state:
        t.normal_(generator=torch.Generator(device="cuda").manual_seed(3))  # what a later chunk finds
    for rows, starts, lens, dstarts, slots, tables, shape, context in cases:
        packed = pack(rows, starts, lens, tables, *shape, runner.width, slots, dstarts, pad_slot=runner.num_slots)
        saved = [t.clone() for t in state]
        with torch.inference_mode():
            eager = [x.clone() for x in prefill_step(runner, packed.cuda(), *shape, context, d is not None)]
            written = [t.clone() for t in state]
            for t, x in zip(state, saved):
                t.copy_(x)
            graphed = graphs.run(packed, (*shape, context, d is not None))
        torch.cuda.synchronize()
        assert len(graphed) == len(eager) == 4
        for name, x, y in zip(("hidden", "features", "logits", "first tokens"), graphed, eager):
            assert torch.equal(x, y), (name, shape, _where(x, y))
        for name, t, w, x in zip(("k", "v", "draft k", "draft v", "draft hidden"), state, written, saved):
            assert torch.equal(t, w), (name, shape, _where(t, w))  # graphed and eager wrote the same
            assert not torch.equal(w, x), (name, shape)  # the step wrote it
    assert len(graphs.graphs) == 3
    # ahead of time: every shape of chunks of up to 2 sequences of up to 20 tokens without a prefix, once
    drafted = d is not None
    assert graphs.capture_all(2, 20) == 2 + 3  # and after a prefix (the whole width; (2, 16) is there)
    assert set(graphs.graphs) >= {(b, q, c, drafted) for b in (1, 2) for q in (16, 32) for c in (0, runner.width * BS)}
    assert graphs.capture_all(2, 20) == 0


@gpu
def test_with_graphs_a_prefill_step_takes_at_most_the_graphs_largest_batch(tmp_path):
    """On a GPU with CUDA graphs a wave of arrivals is prefilled 16 sequences a step (`BATCH_BUCKETS`' largest), so
    that every such step replays a graph; without graphs, or with `max_prefill_seqs=0`, in as few steps as the token
    budget allows."""
    from eyas import LLM
    d = write_tiny_llama(tmp_path / "m", vocab=64, hidden=64, heads=4, kv_heads=2, layers=1, max_pos=256)
    for kw, most in (({"cuda_graphs": True}, BATCH_BUCKETS[-1]), ({"cuda_graphs": False}, 40),
                     ({"cuda_graphs": True, "max_prefill_seqs": 0}, 40)):
        llm = LLM(str(d), device="cuda", dtype="bfloat16", max_num_seqs=40, **kw)
        assert llm.engine.scheduler.max_prefill_seqs == most, kw
