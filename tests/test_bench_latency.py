"""`eyas bench latency` on the CPU: it writes JSON, a markdown table and a plot for plain decoding, chains and the
tree dispatcher, and refuses bad input before loading anything."""
import json
import time
from pathlib import Path

import pytest
import torch

from eyas.bench.latency import rates_from_tpc_report, split_modes, spread, suggest_dispatch
from eyas.cli import main
from eyas.spec.dispatch import compose_dispatch, parse_dispatch
from helpers import SHORT_CONTEXT, interpreted_only, write_mirror_pair


def test_split_modes_keeps_a_dispatch_together():
    assert split_modes("plain,chain:3,dispatch:1=tree:8,16=plain,tree:16") == [
        "plain", "chain:3", "dispatch:1=tree:8,16=plain", "tree:16"]
    assert split_modes("dispatch:2=chain:4,8=plain") == ["dispatch:2=chain:4,8=plain"]


def test_spread_takes_one_prompt_per_category_of_mt_bench():
    assert spread(80, 8) == [0, 10, 20, 30, 40, 50, 60, 70]
    assert spread(3, 5) == [0, 1, 2, 0, 1] and spread(10, 1) == [0]
    for total, n in [(80, 7), (13, 5), (100, 33)]:
        idx = spread(total, n)
        assert len(set(idx)) == n and all(0 <= i < total for i in idx)


def test_accept_rates_from_a_tpc_report(tmp_path):
    """Conditional per-depth rates from the longest chain at T=0 of one draft's `eyas bench tpc` report."""
    def row(spec, t, acc, draft="d"):
        return {"speculation": spec, "temperature": t, "acceptance_by_depth": acc, "draft": draft}
    rows = [row("chain:3", 0.0, [0.6, 0.3, 0.15]), row("tree:8", 0.0, [0.9, 0.8, 0.7, 0.6]),
            row("chain:5", 0.0, [0.5, 0.4, 0.2, 0.1, 0.0]), row("chain:5", 1.0, [0.2, 0.1, 0.05, 0.0, 0.0])]
    path = tmp_path / "tpc.json"
    path.write_text(json.dumps({"results": rows}))
    assert rates_from_tpc_report(path) == pytest.approx([0.5, 0.8, 0.5, 0.5])  # stops where nothing was accepted
    assert rates_from_tpc_report(path, 1.0) == pytest.approx([0.2, 0.5, 0.5])
    path.write_text(json.dumps({"results": rows + [row("chain:3", 0.0, [0.7, 0.5, 0.4], "other")]}))
    with pytest.raises(ValueError, match="several drafts"):
        rates_from_tpc_report(path)
    path.write_text(json.dumps({"results": [row("tree:8", 0.0, [0.9])]}))
    with pytest.raises(SystemExit, match="no chain"):
        main(["bench", "latency", "--model", "llama-3.1-8b-shape", "--accept-rates", str(path)])


def test_bench_latency_writes_json_markdown_and_plot(tmp_path):
    target, draft = write_mirror_pair(tmp_path / "pair", vocab=24, layers=2)
    out = tmp_path / "lat"
    assert main(["bench", "latency", "--model", str(target), "--draft", str(draft), "--modes",
                 "plain,chain:4,dispatch:1=chain:4,2=plain", "--batch-sizes", "1,2", "--max-tokens", "12",
                 "--context", "5", "--num-prompts", "2", "--device", "cpu", "--suggest-dispatch", "tpot",
                 "--out", str(out)]) == 0
    res = json.loads((out / "latency.json").read_text())
    rows = {(r["mode"], r["batch"]): r for r in res["results"]}
    assert set(rows) == {(m, b) for m in ("plain", "chain:4", "dispatch:1=chain:4,2=plain") for b in (1, 2)}
    # the suggested dispatcher: at each batch size the faster of plain and chain:4 by TPOT (the measured dispatcher
    # is no candidate)
    fast = {b: min(("plain", "chain:4"), key=lambda m: rows[(m, b)]["tpot_ms"]) for b in (1, 2)}
    sd = res["meta"]["suggested_dispatch"]
    if fast[1] == fast[2] == "plain":  # (timings on this CPU decide: no dispatcher of plain entries only)
        assert sd is None
    else:
        assert sd["metric"] == "tpot" and sd["per_batch"] == {"1": fast[1], "2": fast[2]}
        assert sd["spec"] == ("dispatch:2=chain:4" if fast[1] == fast[2] == "chain:4" else
                              f"dispatch:1={fast[1]},2={fast[2]}")
    assert not res["meta"]["simulated"] and res["meta"]["attention_pdl"] is False  # the CPU: no PDL
    assert all(r["ttit_ms"] > 0 and r["tokens_per_s"] > 0 and r["tpot_ms"] > 0 for r in rows.values())
    # a request's own time per token: at batch 1, and for plain decoding's requests that finish together, it is the
    # wave's (the two are timed at different host points: equal within timing noise, not bit for bit)
    for key in [("plain", 1), ("plain", 2), ("chain:4", 1)]:
        assert rows[key]["tpot_ms"] == pytest.approx(rows[key]["ttit_ms"], rel=0.3)
    assert rows[("plain", 2)]["tpc"] == 1.0
    # batch 1 runs the 2 prompts one after the other; the timed steps only: 12 tokens, the first from prefill
    assert rows[("plain", 1)]["prompts"] == 2 and rows[("plain", 1)]["decode_steps"] == 22
    assert rows[("plain", 2)]["prompts"] == 2 and rows[("plain", 2)]["decode_steps"] == 11
    assert rows[("chain:4", 1)]["decode_steps"] < 22
    assert rows[("chain:4", 2)]["tpc"] > 1.5  # the mirror draft is accepted
    # the dispatcher runs chain:4 alone and plain steps at batch 2
    assert rows[("dispatch:1=chain:4,2=plain", 1)]["tpc"] > 1.5
    assert rows[("dispatch:1=chain:4,2=plain", 2)]["tpc"] == 1.0
    for b in (1, 2):  # one run each: plain's TTIT over the row's
        assert rows[("chain:4", b)]["speedup_vs_plain"] == pytest.approx(rows[("plain", b)]["ttit_ms"]
                                                                         / rows[("chain:4", b)]["ttit_ms"])
    md = (out / "latency.md").read_text()
    assert "| chain:4 | 2 |" in md and "TPOT ms" in md
    assert (f"`{sd['spec']}`" in md) if sd else "as a dispatcher" not in md
    assert (out / "latency.png").stat().st_size > 1000


def test_bench_latency_times_sampled_decoding(tmp_path, monkeypatch):
    """--temperature / --top-p: every request, warm-up and timed, asks for them (the steps take the multi-round
    acceptance and the sampler); the JSON and the table say so."""
    from eyas.bench.latency import GREEDY, Sampling
    from eyas.engine.engine import LLMEngine
    target, draft = write_mirror_pair(tmp_path / "pair", vocab=24, layers=2)
    asked = []
    add = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, p, params, *a, **k: (
        asked.append(params), add(self, p, params, *a, **k))[1])
    out = tmp_path / "lat"
    assert main(["bench", "latency", "--model", str(target), "--draft", str(draft), "--modes", "plain,chain:4",
                 "--batch-sizes", "2", "--max-tokens", "8", "--context", "5", "--num-prompts", "2", "--device", "cpu",
                 "--temperature", "0.8", "--top-p", "0.9", "--out", str(out)]) == 0
    assert len(asked) == 8  # per mode: 2 warm-up requests and 2 timed
    assert {(p.temperature, p.top_p, p.top_k) for p in asked} == {(0.8, 0.9, -1)}
    assert sorted(p.max_tokens for p in asked) == [4] * 4 + [8] * 4
    res = json.loads((out / "latency.json").read_text())
    assert (res["meta"]["temperature"], res["meta"]["top_p"], res["meta"]["sampling_mode"]) == (0.8, 0.9, "filtered")
    assert {r["mode"] for r in res["results"]} == {"plain", "chain:4"}
    assert "sampled at temperature 0.8, top-p 0.9," in (out / "latency.md").read_text()
    assert (GREEDY.mode, Sampling(1.0).mode, Sampling(1.0, top_k=5).mode) == ("greedy", "sampled", "filtered")


def _row(mode, batch, ttit, tpot=None):
    return {"mode": mode, "batch": batch, "ttit_ms": ttit, "tpot_ms": tpot}


def test_suggest_dispatch_takes_the_fastest_mode_per_batch_size():
    """Session 21's SmolLM2 rows on the H200 (TTIT, TPOT): the default tree up to batch 4, tree:8 from 8, chain:3
    by TTIT at 64; a measured dispatcher is never a candidate, and neighbours with one choice merge."""
    rows = [_row("plain", b, t, t) for b, t in ((1, .477), (2, .570), (4, .744), (8, .751), (64, 1.096))]
    rows += [_row("chain:3", 1, .402, .401), _row("chain:3", 2, .432, .412), _row("chain:3", 4, .474, .428),
             _row("chain:3", 8, .563, .477), _row("chain:3", 64, .870, .700),
             _row("tree:8", 1, .357, .356), _row("tree:8", 2, .438, .413), _row("tree:8", 4, .480, .426),
             _row("tree:8", 8, .538, .445), _row("tree:8", 64, .887, .684),
             _row("tree:smollm2_48d5", 1, .329, .328), _row("tree:smollm2_48d5", 2, .374, .352),
             _row("tree:smollm2_48d5", 4, .440, .389), _row("tree:smollm2_48d5", 8, .544, .455),
             _row("tree:smollm2_48d5", 64, 1.556, 1.240),
             _row("dispatch:1=tree:8,64=plain", 8, .100, .100),  # the fastest row, but a dispatcher
             _row("chain:3|0.5=plain", 8, .090, .090)]  # and temperature bands
    sd = suggest_dispatch(rows, "ttit")
    assert sd["spec"] == "dispatch:4=tree:smollm2_48d5,8=tree:8,64=chain:3"
    assert sd["per_batch"] == {"1": "tree:smollm2_48d5", "2": "tree:smollm2_48d5", "4": "tree:smollm2_48d5",
                               "8": "tree:8", "64": "chain:3"}
    assert suggest_dispatch(rows, "tpot")["spec"] == "dispatch:4=tree:smollm2_48d5,64=tree:8"  # 0.684 < 0.700
    # where plain decoding wins it is an entry; only plain everywhere gives no dispatcher
    rows2 = [_row("plain", 1, 1.0), _row("chain:3", 1, 0.5), _row("plain", 32, 1.0), _row("chain:3", 32, 2.0)]
    assert suggest_dispatch(rows2)["spec"] == "dispatch:1=chain:3,32=plain"
    assert suggest_dispatch([_row("plain", 1, 1.0), _row("chain:3", 1, 2.0)]) is None
    # TPOT falls back to TTIT where a row has none; ties go to the mode measured first
    assert suggest_dispatch([_row("chain:2", 1, 1.0), _row("chain:3", 1, 1.0)], "tpot")["spec"] == \
        "dispatch:1=chain:2"
    with pytest.raises(ValueError, match="metric"):
        suggest_dispatch(rows, "ttft")


def test_compose_dispatch_spelling():
    assert compose_dispatch({64: "chain:3", 1: "tree:8", 2: "tree:8"}) == "dispatch:2=tree:8,64=chain:3"
    d = parse_dispatch(compose_dispatch({1: "chain:4", 4: "plain", 16: "chain:4"}))
    assert d.bounds == [1, 4, 16] and [t.num_nodes for t in d.trees] == [4, 0, 4]
    for bad, msg in (({}, "at least one"), ({0: "chain:3"}, ">= 1"), ({1: "plain", 2: "plain"}, "every entry is plain"),
                     ({1: "tree:nope"}, "unknown tree preset")):
        with pytest.raises(ValueError, match=msg):
            compose_dispatch(bad)


def test_bench_latency_repeat_interleaves_the_modes(tmp_path, monkeypatch):
    """--repeat 3: per batch size each mode's engine is built once and the modes' timed runs alternate (plain,
    chain, plain, chain, ...); each row is the run of median TTIT, with all three runs' TTIT and ms/step in the JSON
    and the table, and the same tokens, steps and TPC as a single run."""
    import eyas.bench.latency as lat
    target, draft = write_mirror_pair(tmp_path / "pair", vocab=24, layers=2)
    args = ["bench", "latency", "--model", str(target), "--draft", str(draft), "--modes", "plain,chain:4",
            "--batch-sizes", "1,2", "--max-tokens", "10", "--context", "5", "--num-prompts", "2", "--device", "cpu"]
    order, built = [], []
    time_row, build_engine = lat.time_row, lat.build_engine
    monkeypatch.setattr(lat, "time_row", lambda engine, mode, batch, *a, **k: (
        order.append((mode, batch)), time_row(engine, mode, batch, *a, **k))[1])
    monkeypatch.setattr(lat, "build_engine", lambda *a, **k: (built.append(a[3:5]), build_engine(*a, **k))[1])
    assert main(args + ["--repeat", "3", "--out", str(tmp_path / "r3")]) == 0
    assert built == [("plain", 1), ("chain:4", 1), ("plain", 2), ("chain:4", 2)]
    assert order == [("plain", 1), ("chain:4", 1)] * 3 + [("plain", 2), ("chain:4", 2)] * 3
    res = json.loads((tmp_path / "r3" / "latency.json").read_text())
    assert res["meta"]["repeat"] == 3
    assert [(r["mode"], r["batch"]) for r in res["results"]] == [("plain", 1), ("plain", 2), ("chain:4", 1),
                                                                  ("chain:4", 2)]
    for r in res["results"]:
        assert len(r["repeats_ttit_ms"]) == 3 and len(r["repeats_ms_per_step"]) == 3
        assert r["ttit_ms"] == sorted(r["repeats_ttit_ms"])[1]
    rows = {(r["mode"], r["batch"]): r for r in res["results"]}
    for b in (1, 2):  # against plain: the median over the rounds of the two runs' ratio
        plain, chain = rows[("plain", b)], rows[("chain:4", b)]
        assert plain["speedup_vs_plain_runs"] == [1.0] * 3
        ratios = [p / c for p, c in zip(plain["repeats_ttit_ms"], chain["repeats_ttit_ms"])]
        assert chain["speedup_vs_plain_runs"] == pytest.approx(ratios)
        assert chain["speedup_vs_plain"] == pytest.approx(sorted(ratios)[1])
    monkeypatch.undo()
    assert main(args + ["--out", str(tmp_path / "r1")]) == 0
    one = json.loads((tmp_path / "r1" / "latency.json").read_text())["results"]
    for a, b in zip(res["results"], one):
        assert (a["mode"], a["batch"], a["decode_steps"], a["tpc"]) == (b["mode"], b["batch"], b["decode_steps"],
                                                                        b["tpc"])
        assert "repeats_ttit_ms" not in b
    md = (tmp_path / "r3" / "latency.md").read_text()
    assert "TTIT of the runs" in md and "vs plain (median of the rounds)" in md


def test_bench_latency_max_model_len_widens_the_block_tables(tmp_path):
    """--max-model-len sets the engine's context bound as a server would (the block tables, and with them the
    attention's split count, are sized by it); one shorter than the prompts plus --max-tokens is refused."""
    from eyas.bench.latency import build_engine, load_models, make_prompts
    target, draft = write_mirror_pair(tmp_path / "pair", vocab=24, layers=2)
    tgt, tok, dr, _ = load_models(str(target), str(draft), torch.device("cpu"), torch.float32)
    prompts = make_prompts(tok, tgt.config.vocab_size, 2, 5, None)
    tight = build_engine(tgt, tok, dr, "chain:2", 1, prompts, 6, None, False)
    wide = build_engine(tgt, tok, dr, "chain:2", 1, prompts, 6, None, False, max_model_len=300)
    assert tight.max_model_len == 5 + 6 + 64 and wide.max_model_len == 300
    assert wide.runner.width > tight.runner.width
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        build_engine(tgt, tok, dr, "chain:2", 1, prompts, 6, None, False, max_model_len=10)
    out = tmp_path / "lat"
    assert main(["bench", "latency", "--model", str(target), "--draft", str(draft), "--modes", "chain:2",
                 "--batch-sizes", "1", "--max-tokens", "6", "--context", "5", "--num-prompts", "1", "--device", "cpu",
                 "--max-model-len", "300", "--out", str(out)]) == 0
    assert json.loads((out / "latency.json").read_text())["meta"]["max_model_len"] == 300
    with pytest.raises(SystemExit, match="shorter than the longest prompt"):
        main(["bench", "latency", "--model", str(target), "--draft", str(draft), "--modes", "chain:2",
              "--batch-sizes", "1", "--max-tokens", "6", "--context", "5", "--num-prompts", "1", "--device", "cpu",
              "--max-model-len", "10", "--out", str(out)])


def test_speedup_over_plain_is_the_median_of_the_rounds_ratios():
    """With repeats, a round's plain and speculative runs ran back to back: the speed-up is the median of the
    per-round ratios (here 2.0), not the ratio of the two medians (1.0 / 0.6); one run each: the plain ratio;
    a batch size without a plain row gets none."""
    from eyas.bench.latency import add_speedups, markdown
    rows = [dict(mode="plain", batch=1, ttit_ms=1.0, repeats_ttit_ms=[1.0, 2.0, 1.0]),
            dict(mode="tree:8", batch=1, ttit_ms=0.6, repeats_ttit_ms=[0.5, 0.8, 0.6]),
            dict(mode="plain", batch=4, ttit_ms=2.0), dict(mode="chain:3", batch=4, ttit_ms=0.8),
            dict(mode="chain:3", batch=8, ttit_ms=0.9)]
    add_speedups(rows)
    assert rows[1]["speedup_vs_plain_runs"] == pytest.approx([2.0, 2.5, 1.0 / 0.6])
    assert rows[1]["speedup_vs_plain"] == pytest.approx(2.0)
    assert rows[3]["speedup_vs_plain"] == pytest.approx(2.5) and "speedup_vs_plain_runs" not in rows[3]
    assert "speedup_vs_plain" not in rows[4]
    for r in rows:
        r.update(ttft_ms=1.0, tpot_ms=None, tpc=1.0, tokens_per_s=1.0, decode_steps=1,
                 ms_per_decode_step=r["ttit_ms"])
    md = markdown(rows, dict(model="m", device_name="cpu", dtype="float32", date="d"))
    assert "| tree:8 | 1 |" in md and " 2.00x |" in md and " 2.50x |" in md


@pytest.mark.parametrize("bad", [["--modes", "tree:nope"], ["--modes", "dispatch:4=chain:3,2=plain"],
                                 ["--batch-sizes", "0"], ["--batch-sizes", "x"], ["--accept-rates", "high"],
                                 ["--num-prompts", "0"], ["--draft-vocab", "-1"], ["--repeat", "0"],
                                 ["--max-model-len", "1"], ["--temperature", "-1"], ["--top-p", "0"],
                                 ["--top-k", "-2"]])
def test_bench_latency_refuses_bad_input(bad, tmp_path):
    with pytest.raises(SystemExit, match="eyas bench latency"):
        main(["bench", "latency", "--model", "no-such-model", "--out", str(tmp_path)] + bad)


def test_bench_latency_refuses_sampling_with_simulated_acceptance(tmp_path):
    """A random-weight shape's speculative rows replay greedy acceptance: sampled timing there is refused before
    anything loads; its plain rows may sample."""
    with pytest.raises(SystemExit, match="simulated"):
        main(["bench", "latency", "--model", "smollm2-shape", "--modes", "plain,chain:3", "--temperature", "1",
              "--out", str(tmp_path)])


def test_accept_ranks_replays_a_recording_on_any_tree(tmp_path):
    """--accept-ranks replays recorded rank paths on a random-weight shape: rows of all rank 0 give every tree its
    longest chain; rows [1, 0, ...] reach tree:8's node [1, 0] (depth 2), which rank-0 rates could never reach."""
    from safetensors.torch import save_file

    def bench(rows):
        path = tmp_path / "ranks.safetensors"
        save_file({"ranks": torch.tensor(rows, dtype=torch.int8).repeat(50, 1)}, str(path))
        out = tmp_path / "lat"
        assert main(["bench", "latency", "--model", "smollm2-shape", "--modes", "chain:3,tree:8", "--batch-sizes", "1",
                     "--max-tokens", "9", "--context", "4", "--num-prompts", "1", "--accept-ranks", str(path),
                     "--device", "cpu", "--dtype", "float32", "--out", str(out)]) == 0
        res = json.loads((out / "latency.json").read_text())
        assert res["meta"]["accept_ranks"] == str(path) and res["meta"]["accept_rates"] is None
        return [r["tpc"] for r in res["results"]]
    # 8 tokens after prefill: chain:3 in calls of 4 + 4; tree:8 down its 4-deep chain, 5 + 3
    assert bench([[0] * 8]) == pytest.approx([4.0, 4.0])
    # the second-ranked token, then the best: off the chain (1 token a call); tree:8's node [1, 0], 3 + 3 + 2
    assert bench([[1, 0, 0, 0, 0, 0, 0, 0]]) == pytest.approx([1.0, 8 / 3])
    bad = tmp_path / "bad.safetensors"
    save_file({"ranks": torch.zeros(3)}, str(bad))
    with pytest.raises(SystemExit, match="integer tensor"):
        main(["bench", "latency", "--model", "smollm2-shape", "--accept-ranks", str(bad)])


def test_replayed_recording_is_read_evenly(tmp_path):
    """Each sequence reads its own stretch of the recording (`replay_seeds`: sequence j of P from row j * T / P), so
    the replayed TPC is the recording's: the first half of these rows accepts a whole chain:3 (4 tokens a call), the
    second nothing (1), and two sequences of 40 decode tokens, one in each half, make 10 + 40 calls."""
    from safetensors.torch import save_file
    from eyas.bench.latency import replay_seeds
    from eyas.spec.tree_builder import MISS
    assert replay_seeds([4, 4, 10], 90) == [86, 26, 50]  # rows 0, 30 and 60 at positions 4, 4 and 10
    rows = torch.cat([torch.zeros(100, 3), torch.full((100, 3), MISS)]).to(torch.int8)
    path = tmp_path / "halves.safetensors"
    save_file({"ranks": rows}, str(path))
    out = tmp_path / "lat"
    assert main(["bench", "latency", "--model", "llama-tiny-shape", "--modes", "chain:3", "--batch-sizes", "1,2",
                 "--max-tokens", "41", "--context", "4", "--num-prompts", "2", "--accept-ranks", str(path),
                 "--device", "cpu", "--dtype", "float32", "--out", str(out)]) == 0
    res = json.loads((out / "latency.json").read_text())["results"]
    assert [r["tpc"] for r in res] == pytest.approx([80 / 50, 80 / 50])


@interpreted_only
def test_replayed_acceptance_on_the_triton_path_equals_the_torch_path(tmp_path):
    """The step's replay of recorded rank paths in one Triton launch (`replay_accept_triton`, as CUDA runs it; the
    interpreter here) commits what its torch reference commits, step by step: same tokens, calls and acceptance by
    depth, on a tree at batch 2 (chains are trees to the kernel; tests/test_verifier.py holds it to the reference
    on chains and trees)."""
    from eyas import LLM, SamplingParams
    from eyas.bench.latency import simulate_acceptance
    target, draft = write_mirror_pair(tmp_path / "pair", vocab=24, layers=1)
    g = torch.Generator().manual_seed(0)
    ranks = torch.where(torch.rand(64, 6, generator=g) < 0.8, 0, torch.randint(1, 3, (64, 6), generator=g))
    outs = []
    for triton in (False, True):
        llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8",
                  max_model_len=SHORT_CONTEXT)
        llm.engine.runner.use_triton = triton
        simulate_acceptance(llm.engine, ranks)
        got = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=10, ignore_eos=True, seed=s)
                                                 for s in (3, 11)])
        outs.append([(o.token_ids, o.stats.target_calls, o.stats.accepted_by_depth) for o in got])
    assert outs[0] == outs[1]
    assert sum(o[1] for o in outs[0]) < 18  # the replay accepted something (9 calls a request without)


def test_bench_latency_times_an_int4_draft(tmp_path):
    """--draft-quant on a random-weight shape: the draft's FFN and head copy become INT4 (here the head of a reduced
    draft vocabulary), acceptance stays simulated, and the replay gives the same TPC as the bf16 draft's."""
    out = tmp_path / "lat"
    args = ["bench", "latency", "--model", "llama-tiny-shape", "--modes", "chain:3", "--batch-sizes", "1",
            "--max-tokens", "9", "--context", "4", "--num-prompts", "1", "--accept-rates", "1,1,1", "--device", "cpu",
            "--dtype", "float32", "--draft-vocab", "64"]
    assert main(args + ["--draft-quant", "int4", "--out", str(out)]) == 0
    res = json.loads((out / "latency.json").read_text())
    assert res["meta"]["draft_quant"] == "int4" and res["meta"]["draft_vocab"] == 64  # read from the draft itself
    assert main(args + ["--out", str(tmp_path / "bf16")]) == 0
    assert json.loads((tmp_path / "bf16" / "latency.json").read_text())["meta"]["draft_quant"] is None
    assert res["results"][0]["tpc"] == pytest.approx(4.0)
    with pytest.raises(SystemExit, match="--draft-quant does not combine with --tensor-parallel"):
        main(args[:-2] + ["--draft-quant", "int4", "--tensor-parallel", "2", "--out", str(tmp_path / "tp")])


def test_bench_latency_takes_the_drafts_own_quantization(tmp_path):
    """A checkpoint's draft whose config.json asks a quantization for the device (`eyas_draft_quant`, as the shipped
    SmolLM2 draft asks fp8-head on a GPU) is timed quantized so, once; `--draft-quant none` times it as it is."""
    target, draft = write_mirror_pair(tmp_path / "pair", vocab=24, layers=2)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eyas_draft_quant"] = {"cpu": "fp8-head"}
    (draft / "config.json").write_text(json.dumps(cfg))
    args = ["bench", "latency", "--model", str(target), "--draft", str(draft), "--modes", "chain:2", "--batch-sizes",
            "1", "--max-tokens", "6", "--context", "4", "--num-prompts", "1", "--device", "cpu", "--dtype", "float32"]
    assert main(args + ["--out", str(tmp_path / "auto")]) == 0
    assert json.loads((tmp_path / "auto" / "latency.json").read_text())["meta"]["draft_quant"] == "fp8-head"
    assert main(args + ["--draft-quant", "none", "--out", str(tmp_path / "none")]) == 0
    assert json.loads((tmp_path / "none" / "latency.json").read_text())["meta"]["draft_quant"] is None


def test_bench_latency_tensor_parallel_equals_tp1(tmp_path):
    """`--tensor-parallel 2` (2 gloo ranks on the CPU) on a random shape built sharded: the same decode steps and TPC
    as TP = 1 (simulated acceptance draws from each request's explicit seed, identically on every rank), with the
    draft replicated or sharded, and half the weight bytes per rank."""
    ranks = "docs/bench/ranks_smollm2_runG_mtbench.safetensors"

    def bench(*extra):
        out = tmp_path / "-".join(extra or ("tp1",))
        assert main(["bench", "latency", "--model", "llama-tiny-shape", "--modes", "plain,chain:3,tree:8",
                     "--batch-sizes", "1,3", "--max-tokens", "10", "--context", "12", "--num-prompts", "3",
                     "--accept-ranks", ranks, "--device", "cpu", "--dtype", "float32", "--out", str(out),
                     *extra]) == 0
        res = json.loads((out / "latency.json").read_text())
        return res["meta"], {(r["mode"], r["batch"]): (r["decode_steps"], r["tpc"]) for r in res["results"]}
    meta1, rows1 = bench()
    meta2, rows2 = bench("--tensor-parallel", "2", "--tp-draft", "replicated")
    meta3, rows3 = bench("--tensor-parallel", "2")
    assert rows1 == rows2 == rows3
    assert rows1[("chain:3", 1)][1] > 1.5  # the replay accepts: speculative steps ran
    assert (meta1["tensor_parallel"], meta2["tensor_parallel"], meta2["draft_sharded"], meta3["draft_sharded"]) == \
        (1, 2, False, True)
    assert meta2["linear_weight_bytes"] * 2 == meta1["linear_weight_bytes"]
    assert "tensor parallel 2 (draft sharded)" in (tmp_path / "--tensor-parallel-2" / "latency.md").read_text()


@pytest.mark.parametrize("bad", [["--tensor-parallel", "0"], ["--tensor-parallel", "-2"],
                                 ["--tensor-parallel", "2", "--draft-vocab", "64"]])
def test_bench_latency_refuses_bad_tensor_parallel(bad, tmp_path):
    with pytest.raises(SystemExit, match="eyas bench latency"):
        main(["bench", "latency", "--model", "llama-tiny-shape", "--out", str(tmp_path)] + bad)


def test_soak_under_tensor_parallel_loses_nothing(tmp_path):
    """`eyas bench soak` at TP = 2 (gloo): bursts and quiet spells through a tree dispatcher, greedy and sampled
    requests, aborts and refusals; every admitted request ends, no KV block stays in use, the ranks never disagree
    (TPEngine's check) and the command returns in bounded time."""
    out = tmp_path / "soak"
    assert main(["bench", "soak", "--model", "llama-tiny-shape", "--tensor-parallel", "2", "--duration", "6",
                 "--max-batch", "6", "--max-prompt", "48", "--max-tokens", "24", "--burst-rate", "50",
                 "--quiet-rate", "5", "--accept-rates", "0.9,0.8,0.7", "--device", "cpu", "--dtype", "float32",
                 "--report-every", "2", "--grace", "120", "--out", str(out)]) == 0
    rep = json.loads((out / "soak.json").read_text())
    assert rep["passed"] and rep["final"] and rep["kv_blocks_in_use"] == 0 and rep["still_running"] == 0
    assert rep["admitted"] == rep["finished"] + rep["aborted"] > 10
    assert max(int(b) for b in rep["batch_sizes_seen"]) > 1 and rep["tokens"] > rep["admitted"]


def test_soak_with_priorities_and_a_small_pool_loses_nothing(tmp_path):
    """The priority policy under the soak's traffic (random priorities, TP = 2) with a KV pool small enough that
    requests are preempted, for higher priorities and for want of blocks: every admitted request ends, no block
    leaks, the ranks agree."""
    out = tmp_path / "soak"
    assert main(["bench", "soak", "--model", "llama-tiny-shape", "--tensor-parallel", "2", "--duration", "5",
                 "--max-batch", "6", "--max-prompt", "48", "--max-tokens", "24", "--burst-rate", "50",
                 "--quiet-rate", "5", "--accept-rates", "0.9,0.8,0.7", "--device", "cpu", "--dtype", "float32",
                 "--scheduling-policy", "priority", "--num-blocks", "40", "--report-every", "2", "--grace", "120",
                 "--out", str(out)]) == 0
    rep = json.loads((out / "soak.json").read_text())
    assert rep["passed"] and rep["kv_blocks_in_use"] == 0 and rep["scheduling_policy"] == "priority"
    assert rep["admitted"] == rep["finished"] + rep["aborted"] > 10 and rep["preemptions"] > 0


def test_soak_clock_starts_after_the_ranks_meet(tmp_path, monkeypatch):
    """The soak's --duration counts traffic, not start-up: in CI the first step (the ranks' first meeting, TP = 2)
    once took 7.3 s, outlasted a 6 s soak, and it admitted nothing. Here the first step sleeps past --duration
    (TP = 1, in this process); requests must still be admitted after it."""
    from eyas.dist.tp import TPEngine
    real_step, calls = TPEngine.step, []

    def slow_first_step(self):
        if not calls:
            time.sleep(2.5)
        calls.append(1)
        return real_step(self)

    monkeypatch.setattr(TPEngine, "step", slow_first_step)
    out = tmp_path / "soak"
    assert main(["bench", "soak", "--model", "llama-tiny-shape", "--duration", "2", "--max-batch", "4",
                 "--max-prompt", "24", "--max-tokens", "8", "--burst-rate", "50", "--quiet-rate", "50",
                 "--accept-rates", "0.9,0.8", "--speculation", "chain:2", "--device", "cpu", "--dtype", "float32",
                 "--out", str(out)]) == 0
    rep = json.loads((out / "soak.json").read_text())
    assert rep["passed"] and rep["startup_s"] >= 2.5 and rep["admitted"] > 0


@pytest.mark.parametrize("bad", [["--duration", "0"], ["--max-batch", "0"], ["--tensor-parallel", "0"],
                                 ["--speculation", "tree:nope"]])
def test_soak_refuses_bad_input(bad, tmp_path):
    with pytest.raises(SystemExit, match="eyas bench soak"):
        main(["bench", "soak", "--model", "llama-tiny-shape", "--out", str(tmp_path)] + bad)


def test_kernel_timeline_is_in_start_order_with_gaps(tmp_path):
    from types import SimpleNamespace as NS

    from eyas.bench.latency import write_kernel_timeline

    def ev(name, start, end):
        return NS(name=name, time_range=NS(start=start, end=end))

    # out of order, one overlapping its predecessor (gap 0, not negative)
    path = tmp_path / "sub" / "k.tsv"
    write_kernel_timeline([ev("c", 130.0, 140.0), ev("a", 100.0, 110.0), ev("b", 108.0, 120.0)], str(path))
    lines = path.read_text().splitlines()
    assert lines[0].split("\t") == ["start_us", "gap_us", "dur_us", "name"]
    assert [ln.split("\t") for ln in lines[1:]] == [["0.0", "0.0", "10.0", "a"], ["8.0", "0.0", "12.0", "b"],
                                                     ["30.0", "10.0", "10.0", "c"]]


def test_profile_counts_the_steps_it_covers(tmp_path, capsys):
    """`--profile`'s three step() calls cover four decode steps where the first enqueues a successor (overlapped
    decoding): the per-step figures divide by the steps launched, not by three."""
    from eyas.bench.latency import profile_steps
    from eyas.engine.engine import EngineConfig, LLMEngine
    from eyas.loader.eagle import load_draft
    from eyas.loader.resolve import load_target
    from eyas.spec.tree import resolve_tree
    target_dir, draft_dir = write_mirror_pair(tmp_path / "pair", vocab=24, layers=2)
    target, _ = load_target(str(target_dir), "cpu", "float32")
    draft = load_draft(str(draft_dir), target)
    for overlap, steps in ((False, 3), (True, 4)):
        engine = LLMEngine(target, None, draft, resolve_tree("chain:2"), EngineConfig(overlap=overlap))
        profile_steps(engine, "chain:2", 1, [[1, 2, 3]])
        assert f"chain:2, batch 1, {steps} decode steps" in capsys.readouterr().out
        assert engine.blocks.num_used == 0


def test_suggest_bands_from_session_59s_runs(tmp_path, capsys):
    """`eyas bench bands` on session 59's SmolLM2 runs on an H100 (docs/bench: greedy, T=0.3, 0.7 and 1): the fitted
    tree at batch 1 and chain:3 at 16 up to 0.3, plain decoding at 16 from 0.7 and everywhere at 1; bands begin
    halfway between measured temperatures and neighbours with the same dispatch merge."""
    from eyas.bench.bands import read_run, suggest_bands
    from eyas.cli import main
    from eyas.spec.tree import resolve_tree
    bench = Path(__file__).parents[1] / "docs/bench"
    files = [str(bench / f"session59_{n}_h100.json") for n in ("race_t1", "greedy", "race_t07", "race_t03")]
    runs = [read_run(f) for f in files]
    assert sorted(t for t, _ in runs) == [0.0, 0.3, 0.7, 1.0]
    out = suggest_bands(runs)
    assert out["per_temperature"] == {"0": "dispatch:1=tree:smollm2_48d5,16=chain:3",
                                      "0.3": "dispatch:1=tree:smollm2_48d5,16=chain:3",
                                      "0.7": "dispatch:1=tree:smollm2_48d5,16=plain", "1": "plain"}
    spec = "dispatch:1=tree:smollm2_48d5,16=chain:3|0.5=dispatch:1=tree:smollm2_48d5,16=plain|0.85=plain"
    assert out["spec"] == spec
    d = resolve_tree(spec)
    assert [d.tree_for(b, t).name for b, t in ((1, 0.0), (16, 0.4), (1, 0.6), (16, 0.6), (1, 0.9))] == [
        "tree:smollm2_48d5", "chain:3", "tree:smollm2_48d5", "chain:0", "chain:0"]
    assert main(["bench", "bands", *files]) == 0
    assert f'--speculation "{spec}"' in capsys.readouterr().out
    # charged for the draft's catch-up a plain entry runs (session 59: 8%), plain loses batch 16 at 0.7 to chain:3
    # (0.751 ms against 0.717 x 1.08), as the shipped draft's bands have it
    assert suggest_bands(runs, plain_entry_cost=1.08)["spec"] == (
        "dispatch:1=tree:smollm2_48d5,16=chain:3|0.85=plain")
    assert main(["bench", "bands", *files, "--plain-entry-cost", "0.5"]) != 0
    # a single temperature: its dispatch alone; plain at every temperature: no speculation
    assert suggest_bands(runs[1:2])["spec"] == "dispatch:1=tree:smollm2_48d5,16=chain:3"
    assert suggest_bands([(1.0, [_row("plain", 1, 1.0), _row("chain:3", 1, 2.0)])]) is None
    for bad in ([], [(0.5, []), (0.5, [])], [(-1.0, [])]):
        with pytest.raises(ValueError):
            suggest_bands(bad)
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"meta": {"simulated": True, "temperature": 0}, "results": [_row("plain", 1, 1.0)]}))
    for f in (junk, sim, tmp_path / "missing.json"):
        with pytest.raises(ValueError):
            read_run(str(f))
    assert main(["bench", "bands", str(junk)]) != 0
    assert "no `meta` and `results`" in capsys.readouterr().err
