"""`eyas run-batch` (eyas/serve/run_batch.py): OpenAI batch files answered offline. The answers equal offline
generation (greedy), come back in the input's order with one line per request, a refused request keeps its line
with the server's 4xx, requests in flight together are batched by the engine, and a bad file is refused, with its
line numbers, before the model loads."""
import asyncio
import json

import pytest

from eyas import LLM, SamplingParams
from eyas.cli import main
from eyas.serve.api_server import create_app
from eyas.serve.run_batch import answer_batch, read_batch
from helpers import noting_batches, write_tiny_chat_model


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from conftest import smollm2_tokenizer
    return write_tiny_chat_model(tmp_path_factory.mktemp("batch_tiny"), smollm2_tokenizer())


QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to three.", "Why is the sky blue?"]


def batch_lines(model: str) -> list[dict]:
    """Chat, completion and Responses requests (greedy, 3..11 tokens), and two the server refuses."""
    lines = []
    for i, q in enumerate(QUESTIONS):
        n = 3 + 2 * i
        lines.append(dict(custom_id=f"chat-{i}", method="POST", url="/v1/chat/completions",
                          body=dict(model=model, messages=[{"role": "user", "content": q}], max_tokens=n,
                                    temperature=0)))
        lines.append(dict(custom_id=f"cmpl-{i}", method="POST", url="/v1/completions",
                          body=dict(model=model, prompt=q, max_tokens=n, temperature=0)))
        lines.append(dict(custom_id=f"resp-{i}", url="/v1/responses",  # method POST by default
                          body=dict(model=model, input=q, max_output_tokens=n, temperature=0)))
    lines.insert(4, dict(custom_id="bad-temperature", method="POST", url="/v1/completions",
                         body=dict(model=model, prompt="hi", max_tokens=3, temperature=-1)))
    lines.insert(9, dict(custom_id="bad-model", method="POST", url="/v1/chat/completions",
                         body=dict(model="no-such-model", messages=[{"role": "user", "content": "hi"}])))
    return lines


@pytest.mark.slow
def test_run_batch_answers_as_offline_generation(chat_dir, tmp_path):
    requests = batch_lines("tiny")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in requests) + "\n\n")  # a blank line is skipped
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", str(chat_dir), "--served-model-name",
                 "tiny", "--device", "cpu", "--dtype", "float32", "--draft", "none", "--max-num-seqs", "4",
                 "--max-concurrency", "6"]) == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [r["custom_id"] for r in requests]  # every line, in order
    assert len({o["id"] for o in out}) == len(out) and all(o["id"].startswith("batch_req_") for o in out)

    offline = LLM(str(chat_dir), device="cpu", dtype="float32")
    by_id = {o["custom_id"]: o for o in out}
    for i, q in enumerate(QUESTIONS):
        greedy = SamplingParams(max_tokens=3 + 2 * i, temperature=0)
        chat = offline.chat([{"role": "user", "content": q}], greedy)[0]
        cmpl = offline.generate([q], greedy)[0]
        got = {k: by_id[f"{k}-{i}"]["response"] for k in ("chat", "cmpl", "resp")}
        assert all(r["status_code"] == 200 for r in got.values())
        assert got["chat"]["body"]["choices"][0]["message"]["content"] == chat.text
        assert got["chat"]["body"]["usage"]["completion_tokens"] == len(chat.token_ids)
        assert got["chat"]["request_id"] == got["chat"]["body"]["id"]
        assert got["cmpl"]["body"]["choices"][0]["text"] == cmpl.text
        assert got["resp"]["body"]["output"][-1]["content"][0]["text"] == chat.text  # the same chat prompt
    # refused requests keep their lines, with the server's answer
    bad_t, bad_m = by_id["bad-temperature"], by_id["bad-model"]
    assert bad_t["error"] is None and bad_t["response"]["status_code"] == 400
    assert "temperature" in bad_t["response"]["body"]["error"]["message"]
    assert bad_m["error"] is None and bad_m["response"]["status_code"] == 404


def test_requests_in_flight_together_are_batched(chat_dir):
    """`--max-concurrency` is what the engine may batch: 8 requests, 8 at once -> steps of several; 1 at a time ->
    every step holds one. The written lines come in the requests' order either way (the later requests are shorter,
    so they finish first)."""
    llm = LLM(str(chat_dir), device="cpu", dtype="float32", max_num_seqs=8)
    batches = noting_batches(llm)
    requests = [dict(custom_id=f"r{i}", url="/v1/completions",
                     body=dict(model="tiny", prompt=QUESTIONS[i % 5], max_tokens=13 - i, temperature=0,
                               ignore_eos=True)) for i in range(8)]
    for concurrency, check in ((8, lambda b: max(b) > 1), (1, lambda b: max(b) == 1)):
        batches.clear()
        lines = []
        counts = asyncio.run(answer_batch(create_app(llm, "tiny"), requests, lines.append, concurrency))
        assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in requests]
        assert counts == dict(requests=8, succeeded=8, failed=0, completion_tokens=sum(13 - i for i in range(8)))
        assert check([b for b in batches if b]), (concurrency, batches)
    assert llm.engine.blocks.num_used == 0


def test_bad_files_are_refused_before_the_model_loads(tmp_path, capsys):
    ok = dict(custom_id="a", method="POST", url="/v1/completions", body=dict(model="m", prompt="x"))
    bad = ["{not json", json.dumps([1, 2]), json.dumps({**ok, "custom_id": ""}), json.dumps(ok),
           json.dumps({**ok, "method": "GET", "custom_id": "b"}), json.dumps({**ok, "custom_id": "c", "url": "/v1/x"}),
           json.dumps({**ok, "custom_id": "d", "body": "text"}),
           json.dumps({**ok, "custom_id": "e", "body": {**ok["body"], "stream": True}}),
           json.dumps({**ok, "custom_id": "f", "url": "/v1/responses", "body": {"input": "x", "background": True}}),
           json.dumps(ok)]  # "a" again
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(bad) + "\n")
    with pytest.raises(ValueError) as e:
        read_batch(src.read_text())
    msg = str(e.value)
    for n, what in ((1, "not JSON"), (2, "JSON object"), (3, "custom_id"), (5, "method must be POST"),
                    (6, "url must be one of"), (7, "body"), (8, "stream"), (9, "background"),
                    (10, "custom_id 'a' repeats line 4")):
        assert f"line {n}: " in msg and what in msg, (n, what, msg)
    assert "line 4:" not in msg and msg.startswith("9 bad line(s)")
    # through the command: exit 2 with the same message, no model loaded (this one does not exist), no output
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", str(tmp_path / "no-model")]) == 2
    assert "9 bad line(s)" in capsys.readouterr().err and not dst.exists()
    src.write_text("\n  \n")
    assert main(["run-batch", "-i", str(src), "-o", str(dst)]) == 2
    assert "no requests" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(dst)]) == 2
    assert "--input-file" in capsys.readouterr().err
    src.write_text(json.dumps(ok) + "\n")
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "no-dir" / "out.jsonl")]) == 2
    assert "--output-file" in capsys.readouterr().err
