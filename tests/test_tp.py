"""Tensor parallelism on the CPU (gloo, 2 processes): TP = 2 equals TP = 1 (logits within 1e-5 in float32, also with
the fast path's fused projections and kernels applied after sharding; greedy speculative output, seeded sampling),
and every rank commits the same tokens.

One `spawn` runs every case on both ranks (each rank writes its results to a file); the oracle is the unsharded model
run in the test process with the same code (world size 1)."""
import json

import pytest
import torch

from eyas.dist import TPEngine, apply_tensor_parallel, spawn
from eyas.dist.tp import load_sharded
from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.loader.resolve import load_target
from eyas.models.fused import enable_fast_path
from eyas.sampling_params import GuidedDecoding, SamplingParams
from eyas.spec.tree import resolve_tree
from helpers import INTERPRETED_ONLY_REASON, NO_CPU_TRITON, write_eagle3_draft, write_mirror_pair, write_tiny_llama

WORLD = 2
# |TP2 - TP1| <= 1e-5 + 1e-5 * |logit|. The row-parallel all-reduce sums the two halves of each o_proj/down_proj
# product in another order than one matmul does: on these random models (logits up to ~7) the worst difference
# measured is 1.2e-5 absolute (2e-6 relative), i.e. float32 rounding, so a purely absolute 1e-5 is slightly exceeded.
TOL_REL = 1e-5


def prompts(vocab, sizes=(1, 3, 7, 12)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in sizes]


def _generate(target, tok, draft, spec, rank, world, params, prompt_list, **engine_kw):
    graphs = next(target.parameters()).device.type == "cuda"  # on GPUs: whole steps replayed from CUDA graphs
    # overlapped decoding (the next step enqueued before this one is read back) on the CPU too: every rank must
    # decide on its successors alike, or the collectives would hang
    cfg = EngineConfig(**({"num_blocks": 64, "block_size": 8, "cuda_graphs": graphs, "overlap": True} | engine_kw))
    eng = LLMEngine(target, tok, draft, resolve_tree(spec), cfg)
    tp = TPEngine(eng, rank, world, check=world > 1)
    out = tp.generate(prompt_list if rank == 0 else None, params if rank == 0 else None)
    stats = (eng.scheduler.num_preemptions, eng.blocks.num_used, eng.step_counts["decode"])
    return out, stats


def run_cases(rank: int, world: int, dirs: dict, device="cpu") -> dict:
    """Every case on this rank; with world = 1 it is the unsharded oracle (no process group needed)."""
    res = {}
    # -- logits: dense forward and the paged engine path (plain greedy decoding, every compute_logits call recorded)
    for name in ("untied", "tied", "qwen3"):
        target, tok = load_target(dirs[name], device, "float32")
        apply_tensor_parallel(target, rank, world)
        V = target.config.vocab_size
        ids = torch.tensor(prompts(V, (9, 9))[:2], device=device)
        pos = torch.arange(9, device=device)[None].expand(2, 9)
        with torch.inference_mode():
            res[f"{name}/dense"] = target.compute_logits(target(ids, pos)).cpu()
        seen = []
        h = target.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.detach().cpu()))
        toks, _ = _generate(target, tok, None, None, rank, world, SamplingParams(max_tokens=6, ignore_eos=True),
                            prompts(V), cuda_graphs=False, overlap=False)  # eager: the hook sees every step's logits
        h.remove()
        res[f"{name}/paged"] = seen
        res[f"{name}/paged_tokens"] = toks
        res[f"{name}/kv_heads"] = target.config.num_key_value_heads
        # the fast path fuses projections after sharding (as the runner does on CUDA): each rank's own shards
        enable_fast_path(target)
        with torch.inference_mode():
            res[f"{name}/dense_fused"] = target.compute_logits(target(ids, pos)).cpu()

    # -- speculative decoding with a replicated draft that accepts often
    target, tok, draft = load_sharded(dirs["mirror_target"], rank, world, device, "float32", dirs["mirror_draft"])
    assert draft.layers[0].self_attn.n_heads == 4  # replicated
    V = 24
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    res["plain/greedy"], _ = _generate(target, tok, None, None, rank, world, greedy, prompts(V))
    for spec in ("chain:3", "tree:8"):
        res[f"{spec}/greedy"], res[f"{spec}/stats"] = _generate(target, tok, draft, spec, rank, world, greedy,
                                                                prompts(V))
    # a small pool: preemption by recompute, decided identically on every rank
    res["tree:8/preempt"], res["tree:8/preempt_stats"] = _generate(target, tok, draft, "tree:8", rank, world, greedy,
                                                                   prompts(V), num_blocks=12, block_size=4)
    # the draft sharded like the target (its row-parallel projections all-reduced too)
    t2, tok2, d2 = load_sharded(dirs["mirror_target"], rank, world, device, "float32", dirs["mirror_draft"],
                                shard_draft=True)
    assert d2.layers[0].self_attn.n_heads == 4 // world
    res["chain:3/greedy_sharded_draft"], res["chain:3/stats_sharded_draft"] = _generate(t2, tok2, d2, "chain:3", rank,
                                                                                        world, greedy, prompts(V))
    # an EAGLE-3 checkpoint's draft (with the target's embedding copied in), replicated and sharded: its first
    # layer's 2H-wide q/k/v split by heads like any, its own head whole on every rank
    for shard in (False, True):
        t3, tok3, d3 = load_sharded(dirs["eagle3_target"], rank, world, device, "float32", dirs["eagle3_draft"],
                                    shard_draft=shard)
        res[f"eagle3/{shard}/greedy"], _ = _generate(t3, tok3, d3, "tree:8", rank, world, greedy, prompts(48))
    sampled = [SamplingParams(temperature=1.0, max_tokens=20, seed=100 + i, ignore_eos=True) for i in range(4)]
    for spec in (None, "chain:3"):
        res[f"{spec}/sampled"], _ = _generate(target, tok, draft if spec else None, spec, rank, world, sampled,
                                              prompts(V))
    # penalties, logit_bias, allowed_token_ids, min_tokens, bad words and log-probabilities: every rank keeps its own
    # penalty rows over the whole (gathered) vocabulary, made and counted alike
    extras = [SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.4,
                             logprobs=3),
              SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={3: 4.0, 5: -100.0}, min_tokens=6,
                             stop_token_ids=[7], bad_words_token_ids=[[3, 3], [9]]),  # 3 favoured, never twice
              SamplingParams(max_tokens=20, ignore_eos=True, allowed_token_ids=[2, 9, 11, 17], presence_penalty=1.0),
              SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)]
    res["tree:8/extras_greedy"], _ = _generate(target, tok, draft, "tree:8", rank, world, extras, prompts(V))
    # guided decoding: every rank keeps its own grammar states, fed the same committed tokens, so its masks agree
    gt, gtok, gd = load_sharded(dirs["guided_target"], rank, world, device, "float32", dirs["guided_draft"])
    guides = [GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), GuidedDecoding(json_object=True),
              GuidedDecoding(regex=r"[a-z ]{5,40}\."), GuidedDecoding(choice=["abc", "ba"])]
    guided = [SamplingParams(max_tokens=20, guided=guides[0]), SamplingParams(max_tokens=20, guided=guides[1]),
              SamplingParams(temperature=1.0, seed=3, max_tokens=20, guided=guides[2]),
              SamplingParams(temperature=1.0, seed=4, max_tokens=20, guided=guides[3])]
    res["tree:8/guided"], _ = _generate(gt, gtok, gd, "tree:8", rank, world, guided,
                                        [gtok.encode(t) for t in ("yes?", "json", "abab", "pick")])
    return res


def _rank_main(rank, world, device, out_dir, dirs):
    import torch.distributed as dist
    res = run_cases(rank, world, dirs, device)
    tokens = {k: v for k, v in res.items() if k.endswith(("greedy", "sampled", "tokens", "preempt", "guided"))}
    everyone = [None] * world
    dist.all_gather_object(everyone, tokens)
    res["ranks_agree"] = all(e == everyone[0] for e in everyone)
    torch.save(res, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    mt, md = write_mirror_pair(d / "mirror", vocab=24, layers=2)
    from helpers import write_guided_mirror
    from test_model_hf import write_tiny_qwen3
    gt, gd, _ = write_guided_mirror(d / "guided")
    e3 = write_tiny_llama(d / "e3", vocab=48, hidden=32, heads=4, kv_heads=2, layers=8, seed=4)
    e3_draft = write_eagle3_draft(d / "e3_draft", e3, draft_vocab=20)
    from safetensors.torch import load_file, save_file
    weights = load_file(e3_draft / "model.safetensors")  # speculators-style: the target's embedding inside
    weights["embed_tokens.weight"] = load_file(e3 / "model.safetensors")["model.embed_tokens.weight"]
    save_file(weights, str(e3_draft / "model.safetensors"))
    return {"guided_target": str(gt), "guided_draft": str(gd), "eagle3_target": str(e3), "eagle3_draft": str(e3_draft),
            "untied": str(write_tiny_llama(d / "untied", vocab=40, hidden=32, heads=4, kv_heads=2, layers=2)),
            "tied": str(write_tiny_llama(d / "tied", vocab=41, hidden=32, heads=4, kv_heads=2, layers=2, tie=True,
                                         seed=3)),  # 41: the vocabulary shards are uneven (21 + 20)
            "mirror_target": str(mt), "mirror_draft": str(md),
            "qwen3": str(write_tiny_qwen3(d / "qwen3", vocab=40, hidden=32, heads=4, kv_heads=2, head_dim=16,
                                          layers=2))}


def _cpu_ranks_take_triton():
    if NO_CPU_TRITON:  # the CPU ranks run the fused path (Triton) on CPU tensors
        pytest.skip(INTERPRETED_ONLY_REASON)


@pytest.fixture(scope="module")
def oracle(dirs):
    _cpu_ranks_take_triton()
    torch.manual_seed(0)
    return run_cases(0, 1, dirs)


@pytest.fixture(scope="module")
def ranks(dirs, tmp_path_factory):
    _cpu_ranks_take_triton()
    out = tmp_path_factory.mktemp("tp_out")
    spawn(_rank_main, WORLD, str(out), dirs, timeout=120, threads=1)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_ranks_commit_the_same_tokens(ranks):
    assert all(r["ranks_agree"] for r in ranks)
    for key in ranks[0]:
        if key.endswith(("greedy", "sampled", "preempt", "tokens")):
            assert ranks[0][key] == ranks[1][key], key
    for name in ("untied", "tied", "qwen3"):  # the gathered logits are the same bits on every rank
        assert torch.equal(ranks[0][f"{name}/dense"], ranks[1][f"{name}/dense"])
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][f"{name}/paged"], ranks[1][f"{name}/paged"]))


@pytest.mark.parametrize("name", ["untied", "tied", "qwen3"])  # qwen3: per-head q/k norms, replicated on each rank
def test_logits_equal_tp1(ranks, oracle, name):
    for r in ranks:
        assert r[f"{name}/kv_heads"] == oracle[f"{name}/kv_heads"] // WORLD  # the KV cache holds this rank's heads
        torch.testing.assert_close(r[f"{name}/dense"], oracle[f"{name}/dense"], atol=1e-5, rtol=TOL_REL)
        torch.testing.assert_close(r[f"{name}/dense_fused"], oracle[f"{name}/dense"], atol=1e-5, rtol=TOL_REL)
        assert len(r[f"{name}/paged"]) == len(oracle[f"{name}/paged"]) > 1  # prefill + decode steps
        for a, b in zip(r[f"{name}/paged"], oracle[f"{name}/paged"]):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-5, rtol=TOL_REL)
        assert r[f"{name}/paged_tokens"] == oracle[f"{name}/paged_tokens"]


@pytest.mark.parametrize("spec", ["plain", "chain:3", "tree:8"])
def test_greedy_speculative_equals_tp1(ranks, oracle, spec):
    assert oracle[f"{spec}/greedy"] == oracle["plain/greedy"]  # the oracle itself: speculation is exact
    for r in ranks:
        assert r[f"{spec}/greedy"] == oracle[f"{spec}/greedy"]
    if spec != "plain":
        preempt, used, decodes = ranks[0][f"{spec}/stats"]
        assert used == 0 and decodes < 4 * 19 / 2  # long draft paths were accepted at TP = 2 too


def test_guided_decoding_equals_tp1(ranks, oracle):
    """Greedy and seeded guided outputs (regex, JSON object, choice) at TP = 2 equal TP = 1's."""
    assert all(r["tree:8/guided"] == oracle["tree:8/guided"] for r in ranks)
    assert any(len(t) > 3 for t in oracle["tree:8/guided"])


def test_penalties_and_logprobs_equal_tp1(ranks, oracle):
    """Requests with penalties, logit_bias, allowed_token_ids, min_tokens, bad words or log-probabilities (greedy and
    seeded) at TP = 2 commit TP = 1's tokens, on every rank; the oracle's are not the free outputs (the extras
    acted)."""
    toks = oracle["tree:8/extras_greedy"]
    assert all(r["tree:8/extras_greedy"] == toks for r in ranks)
    assert set(toks[2]) <= {2, 9, 11, 17} and 5 not in toks[1] and toks[0] != oracle["tree:8/greedy"][0]
    assert 3 in toks[1] and 9 not in toks[1] and not any(a == b == 3 for a, b in zip(toks[1], toks[1][1:]))


def test_sharded_draft_equals_tp1(ranks, oracle):
    assert oracle["chain:3/greedy_sharded_draft"] == oracle["plain/greedy"]
    for r in ranks:
        assert r["chain:3/greedy_sharded_draft"] == oracle["plain/greedy"]
        assert r["chain:3/stats_sharded_draft"] == ranks[0]["chain:3/stats"]  # the same draft, the same steps


def test_eagle3_draft_equals_tp1(ranks, oracle):
    want = oracle["eagle3/False/greedy"]
    for r in ranks:
        assert r["eagle3/False/greedy"] == want and r["eagle3/True/greedy"] == want


def test_preemption_under_tp(ranks, oracle):
    for r in ranks:
        assert r["tree:8/preempt"] == oracle["plain/greedy"]
        assert r["tree:8/preempt_stats"][0] > 0 and r["tree:8/preempt_stats"][1] == 0


@pytest.mark.parametrize("spec", [None, "chain:3"])
def test_seeded_sampling_equals_tp1(ranks, oracle, spec):
    toks = oracle[f"{spec}/sampled"]
    assert len({json.dumps(t) for t in toks}) == len(toks)  # different seeds, different outputs
    for r in ranks:
        assert r[f"{spec}/sampled"] == toks


two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs (NCCL)")


@pytest.fixture(scope="module")
def gpu_runs(dirs, tmp_path_factory):
    """The same cases on 2 GPUs with NCCL (float32, the fast path's kernels, CUDA graphs for the generations), and
    the oracle: the unsharded model on cuda:0, same code."""
    out = tmp_path_factory.mktemp("tp_gpu")
    spawn(_rank_main, WORLD, str(out), dirs, timeout=300)
    torch.manual_seed(0)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)], run_cases(0, 1, dirs, "cuda:0")


@two_gpus
def test_nccl_tp2_equals_tp1_with_cuda_graphs(gpu_runs):
    ranks, oracle = gpu_runs
    assert all(r["ranks_agree"] for r in ranks)
    for name in ("untied", "tied"):
        assert torch.equal(ranks[0][f"{name}/dense"], ranks[1][f"{name}/dense"])  # the same bits on every rank
        for r in ranks:
            torch.testing.assert_close(r[f"{name}/dense"], oracle[f"{name}/dense"], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(r[f"{name}/dense_fused"], oracle[f"{name}/dense"], atol=1e-4, rtol=1e-4)
            for a, b in zip(r[f"{name}/paged"], oracle[f"{name}/paged"]):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert r[f"{name}/paged_tokens"] == oracle[f"{name}/paged_tokens"]
    assert oracle["chain:3/greedy"] == oracle["tree:8/greedy"] == oracle["plain/greedy"]
    for r in ranks:
        for key in ("plain/greedy", "chain:3/greedy", "tree:8/greedy", "None/sampled", "chain:3/sampled",
                    "chain:3/greedy_sharded_draft"):
            assert r[key] == oracle[key], key
        assert r["tree:8/preempt"] == oracle["plain/greedy"]
    assert ranks[0]["chain:3/stats"][1] == 0 and ranks[0]["chain:3/stats"][2] < 4 * 19 / 2
    assert ranks[0]["chain:3/stats_sharded_draft"] == ranks[0]["chain:3/stats"]


def test_indivisible_heads_are_refused(dirs):
    target, _ = load_target(dirs["untied"], "cpu", "float32")
    with pytest.raises(ValueError, match="divisible by 3"):
        apply_tensor_parallel(target, 0, 3)


def _hang_on_rank1(rank, world, device):
    import time
    if rank == 1:
        time.sleep(600)


def _fail_on_rank1(rank, world, device):
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


def test_spawn_never_waits_forever():
    import time
    t = time.monotonic()
    # gloo: the ranks need no GPU each (on a one-GPU machine NCCL's second rank has no device)
    with pytest.raises(TimeoutError):  # a stuck rank: every rank is killed at the deadline
        spawn(_hang_on_rank1, WORLD, backend="gloo", timeout=6, threads=1)
    with pytest.raises(Exception, match="exit code 1"):  # a failing rank: reported, the survivor not waited for
        spawn(_fail_on_rank1, WORLD, backend="gloo", timeout=60, threads=1)
    assert time.monotonic() - t < 40


def test_load_sharded_refuses_indivisible_heads(dirs):
    with pytest.raises(ValueError, match="divisible by 3"):
        load_sharded(dirs["untied"], 0, 3)


def test_build_tp_engine_takes_ngram(dirs):
    """`eyas serve/generate --tensor-parallel N --draft ngram`: the rank's engine proposes n-grams (no draft model
    is loaded; every rank proposes the same from the same tokens), and its greedy output is plain decoding's. One
    rank, in this process (the ranks' agreement is the spawned tests' business)."""
    from eyas.dist.tp import build_tp_engine
    from eyas.engine.llm import LLM
    tp = build_tp_engine(dirs["mirror_target"], "ngram:1:3", "chain:3", 0, 1, "cpu", "float32")
    assert tp.engine.proposer is not None and tp.engine.draft is None and tp.engine.tree.name == "chain:3"
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    got = tp.generate(prompts(24), [params] * 4)
    plain = LLM(dirs["mirror_target"], device="cpu", dtype="float32").generate(prompts(24), params)
    assert [list(g) for g in got] == [o.token_ids for o in plain]


def test_tp_serving_engine_on_one_rank(dirs, monkeypatch):
    """TPServingEngine, the server loop's face of a TPEngine (world size 1 here: the same code as rank 0): requests
    are checked at once and queued, the loop sees work while operations are queued and once the heartbeat is due,
    a request the ranks refuse at their step comes back finished with 'error', and close() stops the ranks."""
    import time
    from eyas.dist.tp import TPServingEngine
    target, tok = load_target(dirs["untied"], "cpu", "float32")
    eng = LLMEngine(target, tok, None, None, EngineConfig(num_blocks=16, block_size=8))
    srv = TPServingEngine(TPEngine(eng, 0, 1), heartbeat_s=0.2)
    assert srv.max_model_len == eng.max_model_len and srv.scheduler is eng.scheduler  # rank 0's state, forwarded
    with pytest.raises(ValueError, match="token ids"):
        srv.add_request([99], SamplingParams(max_tokens=2))  # checked on rank 0 at once, never queued
    srv.step()
    assert not srv.has_unfinished()  # just stepped, nothing queued
    time.sleep(0.25)
    assert srv.has_unfinished()  # the heartbeat is due: an idle server still steps
    srv.step()
    srv.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        srv.add_request([1, 2], SamplingParams(max_tokens=2), request_id="a")  # queued, not yet applied
    assert srv.has_unfinished()
    outs = []
    while srv.has_unfinished() and not any(o.finished for o in outs):
        outs += srv.step()
    assert [o.request_id for o in outs if o.finished] == ["a"] and eng.blocks.num_used == 0
    # refused at the step on every rank (here: the engine's own add_request fails) -> finished with "error"
    monkeypatch.setattr(eng, "add_request", lambda *a, **k: (_ for _ in ()).throw(ValueError("no room")))
    srv.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="b")
    outs = srv.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("b", True, "error")]
    srv.close()
    assert srv.tp.step() is None  # every rank's step returns None from now on


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_slice_wise_loading_equals_load_then_shard(dirs, name, monkeypatch, tmp_path):
    """`load_hf_sharded` (what `load_sharded` does for an HF directory) gives each rank exactly the weights that
    loading the whole checkpoint and sharding it gives (uneven vocabulary shards included: V = 41), from a single
    file and from an indexed multi-file checkpoint, while reading about 1/W of the bytes."""
    import safetensors
    from transformers import LlamaForCausalLM as HF
    from eyas.loader.hf import load_hf_sharded
    multi = tmp_path / "multi"
    HF.from_pretrained(dirs[name]).save_pretrained(multi, max_shard_size="20KB")
    assert (multi / "model.safetensors.index.json").exists()
    real_open = safetensors.safe_open
    read = {"full": 0, "got": 0}

    class Counting:  # safe_open, counting the elements the slices hold against the whole tensors
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            sl = self.f.get_slice(key)

            class S:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, idx):
                    t = sl[idx]
                    read["full"] += torch.Size(sl.get_shape()).numel()
                    read["got"] += t.numel()
                    return t
            return S()

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    for path in (dirs[name], multi):
        for rank in range(WORLD):
            whole, _ = load_target(str(path), "cpu", "float32")
            apply_tensor_parallel(whole, rank, WORLD)
            part, _ = load_hf_sharded(path, rank, WORLD)
            a, b = whole.state_dict(), part.state_dict()
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), k
            assert part.config.num_key_value_heads == whole.config.num_key_value_heads
            if name == "tied":
                assert part.lm_head.weight is part.model.embed_tokens.weight
    assert read["got"] < 0.6 * read["full"]  # each rank read its half (norms are whole, and tiny)
