"""Overlapped decoding (`EngineConfig.overlap`, eyas.spec.carry): the next decode step is enqueued before this one
is read back, its inputs carried on the device. It changes nothing: the carried inputs are the ones the host packs
after committing (the reference), and the outputs, finish reasons and statistics equal sequential decoding's, with
admissions, finishes at different steps, stop tokens, sampling, preemption and aborts in the middle. On the CPU
(eager steps; the CUDA graphs' carry is tests/test_cuda_graph.py's)."""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from eyas import LLM, SamplingParams
from eyas.engine.runner import StepHandle
from eyas.layers.sampler import sampling_mode
from eyas.spec.carry import carry_inputs
from eyas.spec.step import DecodeInputs, DecodeOutputs, spec_step
from helpers import write_mirror_pair, write_random_draft, write_tiny_llama


@pytest.fixture(scope="module")
def mirror_pair(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("random")
    target = write_tiny_llama(d / "t", vocab=17, hidden=32, heads=4, kv_heads=2, layers=2)
    return target, write_random_draft(d / "d", target, layers=1)


def prompts(n=6, vocab=17, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (1, 2, 5, 9, 16, 23, 4, 11)[:n]]


def _llm(pair, spec, **kw):
    target, draft = pair
    return LLM(str(target), device="cpu", dtype="float32", draft=str(draft) if spec else None, speculation=spec,
               block_size=4, **kw)


def _tensors(inp):
    return {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)
            if isinstance(getattr(inp, f.name), torch.Tensor)}


@pytest.mark.parametrize("spec", [None, "chain:3", "tree:8", "dispatch:2=tree:8,4=chain:2", "dyn:k3d4n8"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_carried_inputs_equal_the_packed_ones(mirror_pair, spec, temperature):
    """Step after step (3 sequences in a 4-row buffer: one padding row), the inputs carried on the device from a
    step's outputs equal what the host packs for the next step once it has committed that step's tokens."""
    llm = _llm(mirror_pair, spec)
    engine, runner = llm.engine, llm.engine.runner
    seqs = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=60, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts(3, vocab=24))]
    while not all(s.num_output > 0 for s in seqs):
        engine.step()
    B, tree = 4, runner.tree_for(len(seqs))
    accepted = set()
    for _ in range(12):
        assert engine.scheduler.reserve_ahead(seqs)
        inp = runner.decode_inputs(seqs, B)
        out = spec_step(runner.target, runner.draft, tree, runner.cache, runner.draft_cache, inp, runner.block_size,
                        runner.use_triton, None, sampling_mode([s.params for s in seqs]) == "greedy",
                        runner.draft_hidden)
        carried = dataclasses.replace(inp, **{k: v.clone() for k, v in _tensors(inp).items()})
        carry_inputs(carried, out, runner.block_size, runner.num_slots)
        new_tokens, m = runner.collect(StepHandle(seqs, B, tree, False, out, out.packed, None))
        accepted.update(m)
        for s, toks in zip(seqs, new_tokens):
            engine._commit(s, toks)
        packed = runner.decode_inputs(seqs, B)
        for name, want in _tensors(packed).items():
            assert torch.equal(getattr(carried, name), want), name
    if spec is not None:
        assert len(accepted) > 1  # paths of several lengths were carried


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 5), st.sampled_from([1, 4, 16]), st.booleans(),
       st.booleans(), st.integers(0, 10**6))
def test_triton_carry_equals_the_reference(B, P, short, block_size, draft, strided, seed):
    """`carry_inputs`'s one-launch Triton kernel (under TRITON_INTERPRET on the CPU) equals its torch reference:
    random rows, padding rows among them, paths of every accepted length, a dispatcher's shallower tree (fewer path
    columns than the buffer's), outputs as strided views of one packed tensor (as the greedy acceptance gives)."""
    g = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the compiled kernel on a GPU, the interpreter elsewhere
    D1 = max(1, P - short)  # path columns: the root and the tree's depth
    W, scratch = max(5, -(-(3 * P + 4) // block_size)), 7  # the tables hold the next step's positions
    ri = lambda hi, *shape: torch.randint(0, hi, shape, generator=g).to(dev)  # noqa: E731
    slots = torch.where(ri(3, B) == 0, scratch, ri(scratch, B))
    inp = DecodeInputs(root_tokens=ri(50, B), num_cached=ri(W * block_size - 2 * P, B), num_draft_cached=ri(9, B),
                       block_tables=ri(30, B, W), commit_slots=ri(99, B, P),
                       catchup_tokens=ri(50, B, P) if draft else None, catchup_positions=ri(9, B, P) if draft else None,
                       catchup_slots=ri(99, B, P) if draft else None, catchup_lens=ri(P + 1, B) if draft else None,
                       slots=slots, temperature=torch.zeros(B, device=dev), top_k=ri(3, B),
                       top_p=torch.ones(B, device=dev), min_p=torch.zeros(B, device=dev), seeds=ri(9, B),
                       max_context_len=0)
    packed = torch.cat([ri(D1, B, 1), ri(50, B, D1), ri(50, B, 1)], dim=1)
    if strided:
        out = DecodeOutputs(packed[:, 1: D1 + 1], packed[:, 0], packed[:, D1 + 1], packed)
    else:
        out = DecodeOutputs(packed[:, 1: D1 + 1].clone(), packed[:, 0].clone(), packed[:, D1 + 1].clone(), packed)
    ref = dataclasses.replace(inp, **{k: v.clone() for k, v in _tensors(inp).items()})
    fast = dataclasses.replace(inp, **{k: v.clone() for k, v in _tensors(inp).items()})
    carry_inputs(ref, out, block_size, scratch)
    carry_inputs(fast, out, block_size, scratch, use_triton=True)
    for name, want in _tensors(ref).items():
        assert torch.equal(getattr(fast, name), want), name
    live = slots != scratch
    assert torch.equal(ref.num_cached[~live], inp.num_cached[~live])  # padding rows untouched
    assert torch.equal(ref.root_tokens[live], out.bonus[live])


def _run(llm, params, ps, waiting=None, wasted=None):
    """Generate; returns (outputs, per decode step launched: whether it was a successor). `waiting`: a list that
    gets, per successor, whether requests were waiting (for a place in the full batch) when it was enqueued;
    `wasted`: one that gets, per decode step read back, whether none of its rows committed anything."""
    launches = []
    launch, collect = llm.engine.runner.launch, llm.engine.runner.collect

    def counted(seqs, after=None):
        launches.append(after is not None)
        if after is not None and waiting is not None:
            waiting.append(bool(llm.engine.scheduler.waiting))
        return launch(seqs, after)

    def read(h):
        new_tokens, m = collect(h)
        if wasted is not None:
            wasted.append(not any(new_tokens))
        return new_tokens, m
    llm.engine.runner.launch, llm.engine.runner.collect = counted, read
    try:
        outs = llm.generate(ps, params)
    finally:  # the closures hold `llm`: a cycle that would keep its engine alive until the cycle collector ran
        del llm.engine.runner.launch, llm.engine.runner.collect
    return outs, launches


def _same(a, b, spec=None):
    """Equal outputs. With a dispatcher the trees follow the batch sizes, which overlapping changes (a successor
    keeps a finished request's row one step longer): only greedy requests' tokens (tree-independent) compare."""
    if spec is not None and spec.startswith("dispatch:"):
        assert [o.token_ids for o in a][::2] == [o.token_ids for o in b][::2]  # the tests' even requests are greedy
        return
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [(o.stats.target_calls, o.stats.committed, o.stats.accepted_by_depth) for o in a] == \
        [(o.stats.target_calls, o.stats.committed, o.stats.accepted_by_depth) for o in b]


@pytest.mark.parametrize("pair,spec", [(p, s) for p in ("mirror_pair", "random_pair")  # long / short accepted paths
                                       for s in ("tree:8", "dispatch:1=tree:8,2=chain:2,4=plain")]
                         + [("mirror_pair", None), ("mirror_pair", "chain:3")])
def test_overlapped_decoding_equals_sequential(request, pair, spec):
    """8 requests, at most 3 running (admissions while others decode), each with its own token limit, some sampled,
    some with a stop token: outputs, finish reasons and per-request statistics equal sequential decoding's; many
    steps were overlapped, also while requests waited for a place in the full batch; and with no stop tokens, no
    step was wasted (a successor is launched only when some request in its batch cannot end in the step before).
    Then with a KV pool small enough to preempt."""
    p = request.getfixturevalue(pair)
    vocab = 24 if pair == "mirror_pair" else 17
    ps = prompts(8, vocab=vocab)
    params = [SamplingParams(temperature=[0.0, 0.8][i % 2], max_tokens=6 + 5 * i, seed=i, ignore_eos=True,
                             stop_token_ids=[5] if i in (2, 5) else []) for i in range(8)]
    ref, seq_launches = _run(_llm(p, spec, max_num_seqs=3, overlap=False), params, ps)
    assert not any(seq_launches)
    over = _llm(p, spec, max_num_seqs=3, overlap=True)
    waiting = []
    got, launches = _run(over, params, ps, waiting)
    _same(got, ref, spec)
    assert sum(launches) > len(launches) / 3, launches  # many steps overlapped
    assert any(waiting)  # also while requests waited for a place in the full batch
    assert over.engine.blocks.num_used == 0 and over.engine._inflight is None
    assert sorted(over.engine.scheduler.free_slots) == list(range(3))
    if any(o.finish_reason == "stop" for o in ref):
        assert {o.finish_reason for o in ref} == {"stop", "length"}
    no_stops = [dataclasses.replace(sp, stop_token_ids=[]) for sp in params]
    ref, seq_launches = _run(_llm(p, spec, max_num_seqs=3, overlap=False), no_stops, ps)
    wasted = []
    got, launches = _run(_llm(p, spec, max_num_seqs=3, overlap=True), no_stops, ps, wasted=wasted)
    _same(got, ref, spec)
    assert any(launches) and not any(wasted)
    # preemption: overlapped steps hold their blocks two steps ahead, so the batches may differ from sequential
    # decoding's, and with them a dispatcher's trees: greedy requests only (their tokens do not depend on the tree)
    greedy = [dataclasses.replace(sp, temperature=0.0) for sp in no_stops]
    ref = _llm(p, spec, max_num_seqs=4, overlap=False).generate(ps, greedy)
    small = _llm(p, spec, max_num_seqs=4, overlap=True, num_blocks=20)
    got, launches = _run(small, greedy, ps)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert small.engine.scheduler.num_preemptions > 0 and any(launches)
    assert small.engine.blocks.num_used == 0


@pytest.mark.parametrize("spec", ["chain:3", "tree:8", "dyn:k3d4n8", None])
def test_overlapped_steps_with_logprobs_and_penalties_equal_sequential(mirror_pair, spec):
    """Steps in which requests ask for log-probabilities or apply penalties are overlapped too: the penalties'
    counts gain each step's tokens on the device before the successor reads them (`PenaltyState`), and the
    log-probabilities go to the host behind their own step. Tokens, log-probabilities and statistics equal
    sequential decoding's (greedy and sampled, with a request that asks for neither in the same batches), and many
    steps were overlapped."""
    ps = prompts(6, vocab=24)
    kinds = [dict(logprobs=2), dict(frequency_penalty=0.6, repetition_penalty=1.3), dict(),
             dict(logprobs=0, presence_penalty=0.5, logit_bias={3: 2.0}), dict(repetition_penalty=1.5),
             dict(logprobs=4)]
    params = [SamplingParams(temperature=[0.0, 0.8][i % 2], max_tokens=10 + 4 * i, seed=i, ignore_eos=True, **kw)
              for i, kw in enumerate(kinds)]
    ref, seq_launches = _run(_llm(mirror_pair, spec, max_num_seqs=3, overlap=False), params, ps)
    assert not any(seq_launches)
    over = _llm(mirror_pair, spec, max_num_seqs=3, overlap=True)
    got, launches = _run(over, params, ps)
    _same(got, ref, spec)
    for a, b in zip(got, ref):
        assert (a.logprobs is None) == (b.logprobs is None)
        if b.logprobs is not None:
            assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in x.top] for x in b.logprobs]
            # the batches' rows may differ (a successor keeps a finished row one step longer): float rounding only
            assert np.allclose([[x.logprob] + [v for _, v in x.top] for x in a.logprobs],
                               [[x.logprob] + [v for _, v in x.top] for x in b.logprobs], atol=1e-5, rtol=0)
    assert sum(launches) > len(launches) / 3, launches
    assert over.engine.blocks.num_used == 0 and over.engine._inflight is None


PARAMS30 = SamplingParams(max_tokens=30, ignore_eos=True)


def _with_a_step_in_flight(pair, n):
    """(sequential decoding's outputs of n prompts, an overlapping LLM, its n requests) once a successor is in
    flight."""
    ps = prompts(n, vocab=24)
    ref = [o.token_ids for o in _llm(pair, "chain:3", overlap=False).generate(ps, PARAMS30)]
    llm = _llm(pair, "chain:3", overlap=True)
    seqs = [llm.engine.add_request(p, PARAMS30) for p in ps]
    while llm.engine._inflight is None:
        llm.engine.step()
    return ref, llm, seqs


def test_abort_while_a_step_is_in_flight(mirror_pair):
    """A request aborted while an overlapped step holds it: its blocks and slot are freed, that step's results for
    it are dropped, and the others finish as they would alone."""
    ref, llm, seqs = _with_a_step_in_flight(mirror_pair, 3)
    engine = llm.engine
    assert engine.abort(seqs[1].request_id)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id != seqs[1].request_id
            outs[o.request_id] = o
    assert engine._inflight is None
    assert [outs[s.request_id].token_ids for s in (seqs[0], seqs[2])] == [ref[0], ref[2]]
    assert engine.blocks.num_used == 0
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))


def test_an_admissible_request_is_not_kept_waiting(mirror_pair):
    """A request that fits (a place in the batch and its blocks) stops the overlap: the step in flight is read back
    without a successor, and the next step admits it; one that cannot be admitted yet (a full batch) does not."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ps = prompts(4, vocab=24)
    llm = _llm(mirror_pair, "chain:3", overlap=True, max_num_seqs=3)
    engine = llm.engine
    for p in ps[:2]:
        engine.add_request(p, params)
    while engine._inflight is None:
        engine.step()
    third = engine.add_request(ps[2], params)  # fits: the in-flight step is read back, no successor behind it
    engine.step()
    assert engine._inflight is None
    prefills = engine.step_counts["prefill"]
    engine.step()
    assert engine.step_counts["prefill"] == prefills + 1 and third.num_cached > 0
    while engine._inflight is None:
        engine.step()
    engine.add_request(ps[3], params)  # the batch is full (3): the overlap goes on
    engine.step()
    assert engine._inflight is not None


def test_a_failed_step_leaves_nothing_in_flight(mirror_pair):
    """An exception while a step is read back (here: committing its tokens) drops the successor enqueued behind it;
    once the caller has aborted the requests (as the server does), no block is held and new requests decode as
    they would have."""
    ref, llm, seqs = _with_a_step_in_flight(mirror_pair, 2)
    engine = llm.engine
    commit = engine._commit
    engine._commit = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    engine._commit = commit
    assert engine._inflight is None
    for s in seqs:
        engine.abort(s.request_id)
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()
    assert [o.token_ids for o in llm.generate([s.prompt_ids for s in seqs], PARAMS30)] == ref


def test_a_request_near_its_limit_does_not_stop_the_overlap(mirror_pair):
    """A successor is enqueued even when one request of the batch may reach its token limit in the step before
    (its row is then dropped), as long as another goes on; the outputs stay sequential decoding's."""
    ps = prompts(2, vocab=24)
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)]
    ref = _llm(mirror_pair, "chain:3", overlap=False).generate(ps, params)
    llm = _llm(mirror_pair, "chain:3", overlap=True)
    near = []
    launch = llm.engine.runner.launch

    def watched(seqs, after=None):
        if after is not None:
            near.append([s.num_output + 4 >= s.params.max_tokens for s in seqs])
        return launch(seqs, after)
    llm.engine.runner.launch = watched
    got = llm.generate(ps, params)
    _same(got, ref)
    assert [True, False] in near and [True, True] not in near
    assert llm.engine.blocks.num_used == 0


def test_overlap_is_on_with_cuda_graphs_by_default(mirror_pair):
    assert not _llm(mirror_pair, "chain:3").engine.overlap  # no graphs on the CPU
    assert _llm(mirror_pair, "chain:3", overlap=True).engine.overlap
