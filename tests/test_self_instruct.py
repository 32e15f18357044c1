"""`eyas make-prompts`: user prompts written by the target itself (Magpie-style self-instruct)."""
from __future__ import annotations

import gzip
import json

import pytest
from safetensors.torch import load_file, save_file

from eyas.train.self_instruct import keep_prompt, main, pre_query_text

from helpers import write_tiny_chat_model


def _tok():
    from conftest import smollm2_tokenizer
    return smollm2_tokenizer()


def test_pre_query_text_is_where_the_users_text_starts():
    tok = _tok()
    pre = pre_query_text(tok)
    assert pre.endswith("<|im_start|>user\n") and "<|im_start|>system\n" in pre  # SmolLM2's default system turn
    for text in ("Hello", "Write a poem about\nthe sea."):
        assert tok.apply_chat_template([{"role": "user", "content": text}]).startswith(pre + text)


def test_keep_prompt_filters():
    assert keep_prompt("  How do I bake bread?\n", "stop", 8) == "How do I bake bread?"
    assert keep_prompt("How do I bake bread?", "length", 8) is None  # cut off, not a finished request
    assert keep_prompt("  Hi \n", "stop", 8) is None


def _chatty_model(tmp_path, tok):
    """A tiny random chat model that ends its turn after a few tokens: the end-of-turn token's output row is a large
    multiple of the final norm's weight (all ones), so its logit is large whenever the hidden state's sum is > 0."""
    mdir = write_tiny_chat_model(tmp_path / "m", tok)
    w = load_file(str(mdir / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    w[head] = w[head].clone()
    w[head][tok.eos_token_id] = 3.0
    save_file(w, str(mdir / "model.safetensors"), metadata={"format": "pt"})
    return mdir


def test_make_prompts_writes_what_the_model_says_as_a_user(tmp_path, capsys):
    """Every kept prompt is the text the model itself writes after the pre-query text with the recorded seed, ended
    by the model; prompts are distinct; the output is conversation data that make-distill-data reads."""
    from eyas import LLM, SamplingParams
    from eyas.train.data import normalize_messages, read_jsonl

    tok = _tok()
    mdir = _chatty_model(tmp_path, tok)
    out = tmp_path / "p.jsonl.gz"
    assert main(["--model", str(mdir), "--num", "12", "--out", str(out), "--max-tokens", "6", "--min-chars", "1",
                 "--batch-size", "4", "--device", "cpu", "--no-progress"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recs = [json.loads(x) for x in gzip.open(out, "rt")]
    assert len(recs) == info["prompts"] > 0 and info["tried"] >= len(recs)
    texts = [r["conversations"][0]["content"] for r in recs]
    assert len(set(texts)) == len(texts)
    llm = LLM(str(mdir), device="cpu", dtype="float32")
    prefix = tok.encode(pre_query_text(tok))
    again = llm.generate([prefix] * len(recs), [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6,
                                                               seed=r["seed"]) for r in recs])
    for r, o in zip(recs, again):
        assert o.finish_reason == "stop" and o.text.strip() == r["conversations"][0]["content"]
    # make-distill-data answers them: the training data of a draft
    from eyas.train.distill_data import main as distill
    ans = tmp_path / "a.jsonl"
    assert distill(["--model", str(mdir), "--data", str(out), "--out", str(ans), "--max-tokens", "4",
                    "--device", "cpu", "--no-progress"]) == 0
    capsys.readouterr()
    regen = [normalize_messages(r) for r in read_jsonl(ans)]
    assert len(regen) == len(recs) and [m[0]["content"] for m in regen] == texts
    assert all([m["role"] for m in c] == ["user", "assistant"] for c in regen)
    # a batch far above --num: the same prompts, and no more requests than the prompts still missing ask for
    # (it once sent 4 x batch_size at once: 2,048 requests for 8 prompts at the default batch)
    big = tmp_path / "big.jsonl"
    assert main(["--model", str(mdir), "--num", "12", "--out", str(big), "--max-tokens", "6", "--min-chars", "1",
                 "--batch-size", "64", "--device", "cpu", "--no-progress"]) == 0
    info_big = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [json.loads(x) for x in open(big)] == recs and info_big["tried"] <= 8 * 12
    # a spent budget stops at once and says why; bad arguments are refused
    assert main(["--model", str(mdir), "--num", "3", "--out", str(tmp_path / "q.jsonl"), "--time-budget", "0",
                 "--device", "cpu", "--no-progress"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["prompts"] == 0 and info["stopped"] == "time_budget=0.0s"
    with pytest.raises(ValueError, match="must be >= 1"):
        main(["--model", str(mdir), "--num", "0", "--out", str(tmp_path / "r.jsonl"), "--device", "cpu"])


def test_make_prompts_gives_up_when_the_model_never_ends_its_turn(tmp_path, capsys):
    tok = _tok()
    mdir = write_tiny_chat_model(tmp_path / "m", tok)  # random: the end-of-turn token is one of 49k
    w = load_file(str(mdir / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    w[head] = w[head].clone()
    w[head][tok.eos_token_id] = 0.0  # a logit of 0 among 49k random ones: rarely chosen (never with these seeds)
    save_file(w, str(mdir / "model.safetensors"), metadata={"format": "pt"})
    assert main(["--model", str(mdir), "--num", "2", "--out", str(tmp_path / "p.jsonl"), "--max-tokens", "3",
                 "--batch-size", "1", "--device", "cpu", "--no-progress"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["prompts"] == 0 and info["tried"] == 16 and info["stopped"] == "tried 16 requests"
    assert main(["--model", str(mdir), "--num", "2", "--out", str(tmp_path / "q.jsonl"), "--max-tokens", "3",
                 "--batch-size", "64", "--device", "cpu", "--no-progress"]) == 0  # the cap does not follow the batch
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["prompts"] == 0 and info["tried"] == 16 and info["stopped"] == "tried 16 requests"


def test_make_prompts_with_openings(tmp_path, capsys):
    """--openings: request i's user text starts with opening i mod n; the kept prompt is the opening plus what the
    model wrote after it with the recorded seed."""
    from eyas import LLM, SamplingParams

    tok = _tok()
    mdir = _chatty_model(tmp_path, tok)
    ofile = tmp_path / "openings.txt"
    ofile.write_text("# kinds of task\nWrite a\n\nSolve for x:\n")
    out = tmp_path / "p.jsonl"
    assert main(["--model", str(mdir), "--num", "8", "--out", str(out), "--max-tokens", "6", "--min-chars", "1",
                 "--batch-size", "2", "--device", "cpu", "--no-progress", "--openings", str(ofile)]) == 0
    capsys.readouterr()
    recs = [json.loads(x) for x in open(out)]
    assert recs and {r["opening"] for r in recs} <= {"Write a", "Solve for x:"}
    assert all(r["conversations"][0]["content"].startswith(r["opening"]) for r in recs)
    llm = LLM(str(mdir), device="cpu", dtype="float32")
    pre = pre_query_text(tok)
    again = llm.generate([tok.encode(pre + r["opening"]) for r in recs],
                         [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6, seed=r["seed"]) for r in recs])
    for r, o in zip(recs, again):
        assert o.finish_reason == "stop" and (r["opening"] + o.text).strip() == r["conversations"][0]["content"]
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    for bad, msg in ((tmp_path / "empty.txt", "no openings"), (tmp_path / "missing.txt", "no such file")):
        with pytest.raises(ValueError, match=msg):
            main(["--model", str(mdir), "--num", "2", "--out", str(tmp_path / "q.jsonl"), "--device", "cpu",
                  "--openings", str(bad)])
