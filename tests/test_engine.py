"""The non-speculative engine: batching changes nothing, seeded sampling is reproducible and batch-independent,
top-k/top-p stay inside their sets, bad input raises ValueError."""
import numpy as np
import pytest
import torch

from eyas import LLM, SamplingParams
from helpers import write_tiny_llama

VOCAB = 97


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                            layers=2, max_pos=256)


@pytest.fixture(scope="module")
def alone_greedy(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    return [llm.generate([p], params)[0].token_ids for p in prompts8()]


def prompts8():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 3, 7, 12, 20, 33, 45, 60)]


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"num_blocks": 40, "block_size": 4},  # 156 slots for 8 sequences needing 501: forces preemption
], ids=["plain", "chunked", "preempt"])
def test_batching_changes_nothing(tiny_dir, alone_greedy, engine_kwargs):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", **engine_kwargs)
    together = llm.generate(prompts8(), SamplingParams(max_tokens=40, ignore_eos=True))
    alone = alone_greedy
    assert [o.token_ids for o in together] == alone
    assert llm.engine.blocks.num_used == 0
    if "num_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0


def admissions(llm, prompts, max_tokens):
    """Run `prompts` (greedy, the i-th with max_tokens[i]) through the engine step by step; return their tokens and,
    for each step that admitted waiting requests while others were decoding, (how many it admitted, how many
    waited before it)."""
    eng = llm.engine
    seqs = [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
    sched, seen = eng.scheduler, []
    while eng.has_unfinished():
        waiting, decoding = len(sched.waiting), any(not s.in_prefill for s in sched.running)
        eng.step()
        admitted = waiting - len(sched.waiting)
        if admitted and decoding:
            seen.append((admitted, waiting))
    return [s.output_ids for s in seqs], seen


def test_min_admit_batches_admissions_and_changes_no_token(tiny_dir, alone_greedy):
    """`min_admit`: while others decode, waiting requests are admitted only min_admit (or all that wait) at a time;
    every request still finishes, with the tokens it gets alone. With min_admit=1 (the default) the same run admits
    fewer at a time, so the check can fail."""
    lens = [40, 9, 17, 25, 33, 12, 40, 21]
    want = [a[:n] for a, n in zip(alone_greedy, lens)]
    for min_admit in (1, 3):
        llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_seqs=4, min_admit=min_admit)
        out, seen = admissions(llm, prompts8(), lens)
        assert out == want
        assert llm.engine.blocks.num_used == 0 and not llm.engine.scheduler.waiting
        small = [(a, w) for a, w in seen if a < min(3, w)]
        if min_admit == 3:
            assert seen and not small, seen
        else:
            assert small, seen
    # more than the batch holds: admission opens only when nothing decodes (static batches), and nothing stalls
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_seqs=4, min_admit=10)
    out, seen = admissions(llm, prompts8(), lens)
    assert out == want and not seen
    with pytest.raises(ValueError, match="min_admit"):
        LLM(str(tiny_dir), device="cpu", dtype="float32", min_admit=0)


def staggered_admissions(tiny_dir, lens, **kw):
    """Requests through the engine step by step on a clock the test moves 1 ms a step: the first 4 at once, then
    one a step. Returns their tokens and, for each step that admitted waiting requests while others decoded, how long
    (ms, sorted) each had waited."""
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_seqs=8, **kw)
    eng, now = llm.engine, [0.0]
    eng.scheduler.clock = lambda: now[0]
    seqs, delays = [], []
    while len(seqs) < 8 or eng.has_unfinished():
        for p, n in list(zip(prompts8(), lens))[len(seqs):4 if not seqs else len(seqs) + 1]:
            seqs.append(eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)))
            seqs[-1].arrival = now[0]
        sched = eng.scheduler
        waiting, decoding = list(sched.waiting), any(not s.in_prefill for s in sched.running)
        eng.step()
        admitted = [s for s in waiting if s not in sched.waiting]
        if admitted and decoding:
            delays.append(sorted(round(1000 * (now[0] - s.arrival)) for s in admitted))
        now[0] += 0.001
    assert eng.blocks.num_used == 0
    return [s.output_ids for s in seqs], delays


def test_prefill_wait_shares_prefill_steps_and_changes_no_token(tiny_dir, alone_greedy):
    """`prefill_wait_ms`: while others decode, waiting requests are admitted only once the earliest has waited that
    long, or a whole prefill step's worth (`max_prefill_seqs`) waits; every request gets the tokens it gets alone.
    Requests arriving one a step while 4 decode: with a 3 ms wait the four are admitted together once the earliest
    has waited 3 ms; with a wait longer than the run and prefill steps of 2, in pairs at once; with
    no wait, each at its own next step."""
    lens = [40, 9, 17, 25, 33, 12, 40, 21]
    want = [a[:n] for a, n in zip(alone_greedy, lens)]
    out, delays = staggered_admissions(tiny_dir, lens, prefill_wait_ms=3.0)
    assert out == want
    assert delays == [[0, 1, 2, 3]], delays  # once the earliest had waited 3 ms, all four in one prefill step
    out, delays = staggered_admissions(tiny_dir, lens, prefill_wait_ms=1000.0, max_prefill_seqs=2)
    assert out == want and delays and all(len(d) == 2 for d in delays), delays  # a full step at once
    out, delays = staggered_admissions(tiny_dir, lens)
    assert out == want and delays == [[0]] * 4, delays  # each alone, at the next step
    with pytest.raises(ValueError, match="prefill_wait"):
        LLM(str(tiny_dir), device="cpu", dtype="float32", prefill_wait_ms=-1)


def test_max_prefill_seqs_caps_a_prefill_step_and_changes_no_token(tiny_dir, alone_greedy):
    """`max_prefill_seqs`: a prefill step takes at most that many sequences (on a GPU with CUDA graphs it defaults
    to the prefill graphs' largest batch, so a wave of arrivals is not prefilled eagerly at its own shape); the
    rest wait for the next step, and every request gets the tokens it gets alone. Without the cap (the CPU's
    default) the same wave is one step, so the check can fail."""
    for cap, most in ((None, 8), (3, 3), (0, 8)):
        kw = {} if cap is None else {"max_prefill_seqs": cap}
        llm = LLM(str(tiny_dir), device="cpu", dtype="float32", **kw)
        eng, taken = llm.engine, []
        seqs = [eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts8()]
        while eng.has_unfinished():
            before = eng.step_counts["prefill"]
            in_prefill = sum(s.in_prefill for s in eng.scheduler.running) + len(eng.scheduler.waiting)
            eng.step()
            if eng.step_counts["prefill"] > before:
                taken.append(in_prefill - sum(s.in_prefill for s in eng.scheduler.running)
                             - len(eng.scheduler.waiting))
        assert [s.output_ids for s in seqs] == alone_greedy
        assert max(taken) == most, (cap, taken)
        assert llm.engine.blocks.num_used == 0
    with pytest.raises(ValueError, match="max_prefill_seqs"):
        LLM(str(tiny_dir), device="cpu", dtype="float32", max_prefill_seqs=-1)


def test_seeded_sampling_reproducible_and_batch_independent(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32")
    # half of them filter (top-p), half do not: alone, those take the softmax's path (`accept_tree_logits`), in the
    # batch the filters' (`accept_tree` on the filtered probabilities), and must sample the same tokens
    params = [SamplingParams(temperature=1.0, top_p=0.9 if s % 2 else 1.0, max_tokens=20, seed=s, ignore_eos=True)
              for s in range(8)]
    together = [o.token_ids for o in llm.generate(prompts8(), params)]
    again = [o.token_ids for o in llm.generate(prompts8()[::-1], params[::-1])][::-1]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts8(), params)]
    assert together == again == alone
    # different seeds give different samples
    other = llm.generate(prompts8()[:1], SamplingParams(temperature=1.0, max_tokens=20, seed=1234, ignore_eos=True))
    assert other[0].token_ids != together[0]


def allowed_set(logits: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p may emit, computed independently in numpy (float64)."""
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(logits[order] - logits[order].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    return set(order[before < top_p - 1e-6].tolist()) | {int(order[0])}


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (-1, 0.5), (10, 0.7)])
def test_top_k_top_p_never_leave_the_set(tiny_dir, top_k, top_p):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 42]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
    ok = allowed_set(logits / 1.5, top_k, top_p)  # top-p acts on the tempered distribution
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_seqs=512)
    params = [SamplingParams(temperature=1.5, top_k=top_k, top_p=top_p, max_tokens=1, seed=s) for s in range(400)]
    firsts = [o.token_ids[0] for o in llm.generate([prompt] * 400, params)]
    assert set(firsts) <= ok
    assert len(set(firsts)) > 1  # it does sample


def test_bad_input(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    for p in (0.0, 1.5, -1):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=p)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * 300], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, VOCAB + 5]], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams())
    assert llm.engine.blocks.num_used == 0 and not llm.engine.has_unfinished()
    # a bad request after good ones: none of them stays queued, and the next call's outputs are its own
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2], [3, 4], [1, VOCAB + 5]], params)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used == 0
    outs = llm.generate([[5, 6]], params)
    assert len(outs) == 1 and outs[0].token_ids == LLM(str(tiny_dir), device="cpu", dtype="float32").generate(
        [[5, 6]], params)[0].token_ids


def test_smollm2_text_and_stops(smollm2):
    out = smollm2.generate(["The capital of France is"], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    assert out.text == smollm2.tokenizer.decode(out.token_ids)
    # a stop string cuts the text before it and ends the request there
    stop_at = out.text.strip().split(" ")[1]
    cut = smollm2.generate(["The capital of France is"], SamplingParams(max_tokens=16, stop=[stop_at]))[0]
    assert cut.finish_reason == "stop" and stop_at not in cut.text and out.text.startswith(cut.text)
    assert len(cut.token_ids) < 16
    # include_stop_str_in_output (vLLM's): the same end, the stop string kept (the first of the list that is there)
    kept = smollm2.generate(["The capital of France is"], SamplingParams(
        max_tokens=16, stop=["no such stop", stop_at], include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.token_ids == cut.token_ids and kept.text == cut.text + stop_at
    # EOS ends a chat answer unless ignore_eos
    chat = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == smollm2.tokenizer.eos_token_id


def test_cuda_graphs_auto_follows_the_device(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", cuda_graphs="auto")
    assert llm.engine.config.cuda_graphs is False and llm.engine.runner.graphs is None
    with pytest.raises(ValueError, match="CUDA graphs need"):
        LLM(str(tiny_dir), device="cpu", dtype="float32", cuda_graphs=True)


def test_context_buckets_steer_the_triton_steps_bound(tiny_dir, monkeypatch):
    """On the Triton kernels a decode step's max_context_len (which there only steers the attention's split count)
    is the context bucket above the longest committed length plus the lookahead, the same for an eager step as for
    its graph (`eyas.engine.cuda_graph.context_bucket`); the reference keeps the exact bound it gathers keys by."""
    from types import SimpleNamespace

    import eyas.engine.cuda_graph as cg
    monkeypatch.setattr(cg, "CONTEXT_BUCKETS", (16, 32))
    assert [cg.context_bucket(n, 48) for n in (0, 16, 17, 32, 33, 48, 99)] == [16, 16, 32, 32, 48, 48, 48]
    assert cg.context_bucket(20, 32) == 32 and cg.context_bucket(5, 16) == 16 and cg.context_bucket(5, 8) == 8
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_model_len=200)
    r = llm.engine.runner
    full = r.width * r.block_size
    seqs = [SimpleNamespace(num_cached=n) for n in (3, 14, 40)]
    la = r.lookahead
    assert [r.context_bound(seqs[:k]) for k in (1, 2, 3)] == [cg.context_bucket(n + la, full) for n in (3, 14, 40)]
    assert r.context_bound(seqs[:1]) == 16 and r.context_bound(seqs) == full


def test_truncate_prompt_tokens(tiny_dir):
    """`SamplingParams.truncate_prompt_tokens` (vLLM's): the engine reads the prompt's last k tokens only, so a prompt
    longer than the context is taken, and the output is that of the truncated prompt."""
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_model_len=64)
    long = [(7 * i + 1) % VOCAB for i in range(100)]
    with pytest.raises(ValueError, match="context"):
        llm.generate([long], SamplingParams(max_tokens=4))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = llm.generate([long], SamplingParams(max_tokens=8, ignore_eos=True, truncate_prompt_tokens=20))[0]
    assert got.prompt_token_ids == long[-20:]
    assert got.token_ids == llm.generate([long[-20:]], params)[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
