"""Disaggregated prefill and decode (eyas.engine.disagg): the output of a prefill engine handing requests to a decode
engine equals one engine's, token for token, greedy and seeded, plain, speculative and guided; in turn and on a
prefill thread; when the decode engine has no room (the request is prefilled again there); with aborts at every
stage, and no KV block left in either pool."""
import httpx
import pytest
import torch

from eyas import LLM, GuidedDecoding, SamplingParams
from eyas.engine.disagg import DisaggregatedEngine, split_devices
from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.loader.eagle import load_draft
from eyas.loader.resolve import load_target
from eyas.spec.tree import resolve_tree
from helpers import write_guided_mirror

PROMPTS = ["Hello there", "yes or no?", "{\"", "abcabc " * 9, "12 12 12", "a", "The end is near, said the"]


def params():
    return ([SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=2)]
            + [SamplingParams(temperature=1.0, seed=s, max_tokens=20, logprobs=2 * s - 2) for s in (1, 2)]
            + [SamplingParams(max_tokens=30, guided=GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"))]
            + [SamplingParams(max_tokens=16, stop=["e"], logprobs=1, frequency_penalty=0.5, min_tokens=3)]
            + [SamplingParams(max_tokens=1, prompt_logprobs=0)]
            + [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40,
                              guided=GuidedDecoding(json_object=True))])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The mirror pair over a tiny tokenizer, its draft's fc reading the target's features a little too (the
    mirror draft ignores them), so that its proposals depend on every cache row a handoff carries."""
    from safetensors.torch import load_file, save_file
    target, draft, _ = write_guided_mirror(tmp_path_factory.mktemp("disagg"))
    file = draft / "model.safetensors"
    sd = load_file(file)
    fc = sd["fc.weight"]
    H = fc.shape[0]
    fc[:, H:] = torch.randn(H, H, generator=torch.Generator().manual_seed(0)) * 0.3 / H ** 0.5
    save_file(sd, file)
    return str(target), str(draft)


def engine(pair, spec, role="both", **kw):
    target, tok = load_target(pair[0], "cpu", "float32")
    draft = load_draft(pair[1], target) if spec else None
    return LLMEngine(target, tok, draft, resolve_tree(spec), EngineConfig(role=role, **({"num_blocks": 96,
                                                                                          "block_size": 4} | kw)))


def run(eng, prompts, plist, abort_at=None):
    """Every request to its end (`abort_at`: {step: request index} aborts); {index: (tokens, text, reason)}."""
    handles = [eng.add_request(p, sp) for p, sp in zip(prompts, plist)]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if abort_at and steps in abort_at:
            assert eng.abort(handles[abort_at[steps]].request_id)
        assert steps < 500
    # the draft's proposals, and so its acceptance, depend on every cache row it reads: equal stats say the draft
    # KV and its pending features came across intact (the tokens alone would not: verification hides a bad draft)
    return {i: (list(h.output_ids), h.text, h.finish_reason, h.stats.target_calls, list(h.stats.accepted_by_depth))
            for i, h in enumerate(handles) if not (abort_at and i in abort_at.values())}


@pytest.mark.parametrize("spec,threaded", [(None, False), ("chain:3", False), ("tree:8", False), ("tree:8", True)])
def test_disaggregated_equals_one_engine(pair, spec, threaded):
    ref = run(engine(pair, spec), PROMPTS, params())
    dis = DisaggregatedEngine(engine(pair, spec, "prefill", max_num_batched_tokens=16), engine(pair, spec),
                              threaded=threaded)
    try:
        assert run(dis, PROMPTS, params()) == ref
        assert dis.decode.step_counts["prefill"] == 0  # every request came prefilled
        assert dis.prefill.step_counts["decode"] == 0
        if spec:
            assert sum(sum(r[4]) for r in ref.values()) > 0  # drafts were accepted
        for e in (dis.prefill, dis.decode):
            assert e.blocks.num_used == 0 and not e.has_unfinished()
    finally:
        dis.close()


def test_a_full_decode_engine_prefills_again(pair):
    """A decode engine of one place and a small pool: handoffs wait there and are prefilled anew, same output."""
    ref = run(engine(pair, "chain:3"), PROMPTS, params())
    dis = DisaggregatedEngine(engine(pair, "chain:3", "prefill"),
                              engine(pair, "chain:3", max_num_seqs=2, num_blocks=40))
    assert run(dis, PROMPTS, params()) == ref
    assert dis.decode.step_counts["prefill"] > 0  # some were prefilled again
    assert dis.decode.blocks.num_used == 0 and dis.prefill.blocks.num_used == 0


@pytest.mark.parametrize("threaded", [False, True])
def test_aborts_at_every_stage(pair, threaded):
    """Aborted while queued for prefill, while prefilling (a long prompt in chunks), and while decoding: the others'
    outputs do not change and no block is left."""
    ref = run(engine(pair, "tree:8"), PROMPTS, params())
    dis = DisaggregatedEngine(engine(pair, "tree:8", "prefill", max_num_batched_tokens=8, max_num_seqs=2),
                              engine(pair, "tree:8"), threaded=threaded)
    try:
        out = run(dis, PROMPTS, params(), abort_at={1: 6, 2: 3, 6: 0})
        assert out == {i: ref[i] for i in out} and set(out) == {1, 2, 4, 5}
        for e in (dis.prefill, dis.decode):
            assert e.blocks.num_used == 0 and not e.has_unfinished()
        assert not dis.abort("unknown") and not dis.has_unfinished()
    finally:
        dis.close()


def test_handoffs_must_fit_the_decode_engine(pair, tmp_path):
    from helpers import write_tiny_llama
    pre = engine(pair, None, "prefill")
    pre.add_request("Hello there", SamplingParams(max_tokens=5))
    while not pre.handoffs:
        pre.step()
    h = pre.take_handoffs()[0]
    other = write_tiny_llama(tmp_path / "other", vocab=300, hidden=64, layers=3)
    t, tok = load_target(str(other), "cpu", "float32")
    with pytest.raises(ValueError, match="do not fit"):
        LLMEngine(t, tok, None, None, EngineConfig(num_blocks=32)).add_prefilled(h)
    with pytest.raises(ValueError, match="without a draft"):
        engine(pair, "chain:3").add_prefilled(h)
    with pytest.raises(ValueError, match="role"):
        engine(pair, None, "decode")
    with pytest.raises(ValueError, match="prefill engine"):
        DisaggregatedEngine(engine(pair, None), engine(pair, None))
    with pytest.raises(ValueError, match="PREFILL_DEVICE"):
        split_devices("cpu")


def assert_same_logprobs(out, ref):
    """The requests that asked for log-probabilities got one per token, the first one's (from the prefill engine,
    carried by the handoff) included, as one engine's up to float noise; and those that asked for the prompt's (the
    prefill engine's, carried by the handoff or, for a request that ends there, with its output), theirs."""
    asked = [(o, r) for o, r in zip(out, ref) if r.logprobs is not None]
    assert len(asked) == 3
    for o, r in asked:
        assert len(o.logprobs) == len(o.token_ids) == len(r.logprobs)
        assert [[i for i, _ in e.top] for e in o.logprobs] == [[i for i, _ in e.top] for e in r.logprobs]
        assert [e.logprob for e in o.logprobs] == pytest.approx([e.logprob for e in r.logprobs], abs=1e-5)
    prompted = [(o, r) for o, r in zip(out, ref) if r.prompt_logprobs is not None]
    assert len(prompted) == 2 and len(prompted[0][1].prompt_logprobs) > 1  # (the other's prompt is one token)
    assert_same_prompt_logprobs(*zip(*prompted))


def assert_same_prompt_logprobs(out, ref):
    for o, r in zip(out, ref, strict=True):
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == len(o.prompt_token_ids)
        assert [[i for i, _ in e.top] for e in o.prompt_logprobs[1:]] == [[i for i, _ in e.top]
                                                                         for e in r.prompt_logprobs[1:]]
        assert [e.logprob for e in o.prompt_logprobs[1:]] == \
            pytest.approx([e.logprob for e in r.prompt_logprobs[1:]], abs=1e-5)


def test_llm_disaggregate(pair):
    """`LLM(..., disaggregate="cpu,cpu")`: two engines, a prefill thread, the same outputs as one engine."""
    plist = params()
    ref = LLM(pair[0], device="cpu", dtype="float32", draft=pair[1], speculation="chain:3").generate(PROMPTS, plist)
    llm = LLM(pair[0], dtype="float32", draft=pair[1], speculation="chain:3", disaggregate="cpu,cpu")
    try:
        out = llm.generate(PROMPTS, plist)
        assert [(o.token_ids, o.text, o.finish_reason, o.stats.accepted_by_depth) for o in out] == \
            [(o.token_ids, o.text, o.finish_reason, o.stats.accepted_by_depth) for o in ref]
        assert all(o.ttft is not None and o.latency >= o.ttft for o in out)
        assert sum(o.stats.target_calls for o in out) > 0
        assert_same_logprobs(out, ref)
    finally:
        llm.engine.close()


def test_prefill_in_a_process_of_its_own(pair):
    """`LLM(..., prefill_process=True)`: the prefill engine in a spawned child process; the same outputs and
    acceptance as one engine (greedy, seeded, stop strings, max_tokens 1, guided), aborts while the child holds a
    request, a child's failure raised in the parent, and the child gone after close()."""
    from eyas.engine.prefill_process import RemotePrefillEngine
    plist = params()
    ref_llm = LLM(pair[0], device="cpu", dtype="float32", draft=pair[1], speculation="chain:3")
    ref = ref_llm.generate(PROMPTS, plist)
    llm = LLM(pair[0], dtype="float32", draft=pair[1], speculation="chain:3", disaggregate="cpu,cpu",
              prefill_process=True)
    eng = llm.engine
    remote = eng.prefill
    assert isinstance(remote, RemotePrefillEngine)
    try:
        out = llm.generate(PROMPTS, plist)
        assert [(o.token_ids, o.text, o.finish_reason, o.stats.accepted_by_depth) for o in out] == \
            [(o.token_ids, o.text, o.finish_reason, o.stats.accepted_by_depth) for o in ref]
        assert all(o.ttft is not None and o.latency >= o.ttft for o in out)
        assert_same_logprobs(out, ref)
        # aborted at once (queued in the child) and after a few steps; the others finish as before
        got = run(eng, PROMPTS, plist, abort_at={1: 0, 4: 3})
        assert got[1][0] == ref[1].token_ids and got[6][0] == ref[6].token_ids
        assert not remote.seqs and eng.decode.blocks.num_used == 0
        # a request that ends in the child (max_tokens 1) sends its prompt's log-probabilities with its output
        one = SamplingParams(max_tokens=1, prompt_logprobs=1)
        assert_same_prompt_logprobs(llm.generate([PROMPTS[3]], one), ref_llm.generate([PROMPTS[3]], one))
        # an unseeded sampled request keeps the seed the parent drew for it (the child sampled its first token so)
        h = eng.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
        local, seed, arrival = h.seq, h.seq.seed, h.seq.arrival
        while eng.has_unfinished():
            eng.step()
        assert h.seq is not local and h.seq.finish_reason == "length"  # decoded after a handoff
        assert (h.seq.seed, h.seq.arrival) == (seed, arrival)  # TTFT counts from the parent's arrival
        # a request the child cannot take: its failure comes back as the parent's error
        remote._commands.put(("add", "bad", [10 ** 9], SamplingParams(max_tokens=2), 0, 0.0))
        remote.seqs["bad"] = eng.decode.new_sequence([1], SamplingParams(max_tokens=2), "bad")
        with pytest.raises(RuntimeError, match="prefill process failed"):
            for _ in range(300):
                remote.step(0.05)
        remote._proc.join(10)  # the child ends after reporting; a later read says so, and does not wait forever
        with pytest.raises(RuntimeError, match="died"):
            remote.step(5.0)
    finally:
        eng.close()
    assert not remote._proc.is_alive()
    with pytest.raises(ValueError, match="disaggregate"):
        LLM(pair[0], dtype="float32", prefill_process=True)


@pytest.mark.parametrize("process", [False, True])
def test_server_on_a_disaggregated_engine(pair, process):
    """`eyas serve --disaggregate cpu,cpu`'s engine behind the OpenAI API (`--prefill-process`: the prefill engine
    in a child process): chat, streamed and not, seeded n > 1 choices, and a guided (JSON object) chat equal one
    engine's offline outputs; both pools end empty."""
    from eyas.serve.api_server import create_app
    from test_server import LiveServer
    one = LLM(pair[0], device="cpu", dtype="float32", draft=pair[1], speculation="tree:8")
    conv = [{"role": "user", "content": "say yes or no"}]
    greedy = one.chat(conv, SamplingParams(max_tokens=24))[0]
    seeded = one.generate(["abc"] * 3, [SamplingParams(temperature=1.0, seed=5 + j, max_tokens=12) for j in range(3)])
    guided = one.chat(conv, SamplingParams(max_tokens=30, guided=GuidedDecoding(json_object=True)))[0]
    llm = LLM(pair[0], dtype="float32", draft=pair[1], speculation="tree:8", disaggregate="cpu,cpu",
              prefill_process=process)
    server = LiveServer(create_app(llm, "m"))
    try:
        client = server.client()
        r = client.chat.completions.create(model="m", messages=conv, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == greedy.text
        chunks = client.chat.completions.create(model="m", messages=conv, max_tokens=24, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy.text
        r = client.completions.create(model="m", prompt="abc", max_tokens=12, temperature=1.0, seed=5, n=3)
        assert [c.text for c in r.choices] == [o.text for o in seeded]
        r = client.chat.completions.create(model="m", messages=conv, max_tokens=30, temperature=0,
                                           response_format={"type": "json_object"})
        assert r.choices[0].message.content == guided.text and guided.text.startswith("{")
        server.wait_idle()
        assert llm.engine.decode.blocks.num_used == 0
        assert not llm.engine.prefill.seqs if process else llm.engine.prefill.blocks.num_used == 0
        r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)  # two engines: refused, with its reason
        assert r.status_code == 400 and "single engine" in r.json()["error"]["message"]
    finally:
        server.close()
        llm.engine.close()


def test_a_dead_childs_last_message_is_still_read():
    """The child puts its error and returns; the parent's timed get may miss it and then find the child dead. The
    message is in the pipe by then (a child flushes its queues before exiting), and the parent reads it rather than
    reporting a death without a cause (a CI failure: 'the prefill process died (exit code 0)')."""
    import queue
    from types import SimpleNamespace

    from eyas.engine.prefill_process import RemotePrefillEngine

    class LateQueue:  # the first get times out, as the message lands just after it
        def __init__(self):
            self.calls = 0

        def get(self, timeout=None):
            self.calls += 1
            if self.calls == 1:
                raise queue.Empty
            return ("error", "Traceback: the child's error")

        get_nowait = get

    remote = RemotePrefillEngine.__new__(RemotePrefillEngine)
    remote._results = LateQueue()
    remote._proc = SimpleNamespace(is_alive=lambda: False, exitcode=0)
    remote.seqs, remote._handoffs = {}, []
    with pytest.raises(RuntimeError, match="prefill process failed:\nTraceback: the child's error"):
        remote.step(wait=0.01)
    # a child that died without a word is still reported so
    remote._results = SimpleNamespace(get=lambda timeout=None: (_ for _ in ()).throw(queue.Empty),
                                      get_nowait=lambda: (_ for _ in ()).throw(queue.Empty))
    with pytest.raises(RuntimeError, match=r"died \(exit code 0\)"):
        remote.step(wait=0.01)
