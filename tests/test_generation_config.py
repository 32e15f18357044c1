"""A model's generation_config.json (eyas.loader.hf.generation_defaults), as vLLM reads it: its sampling settings
are the defaults of what a request leaves out (`eyas serve --generation-config auto`, the default; `LLM.generate`
without params), `--generation-config vllm` ignores them, and its end-of-sequence ids stop the output."""
import json

import httpx

from eyas import LLM, SamplingParams
from helpers import write_tiny_llama

VOCAB = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _ids(r) -> list[int]:
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_generation_config_defaults(tmp_path):
    from eyas.serve.api_server import create_app
    from test_server import LiveServer
    path = write_tiny_llama(tmp_path / "m", vocab=VOCAB, hidden=32, heads=4, kv_heads=2, layers=2)
    plain = LLM(str(path), device="cpu", dtype="float32")
    free = plain.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    pen = plain.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.5))[0]
    at = next(i for i, t in enumerate(pen.token_ids) if i >= 3 and t not in pen.token_ids[:i])
    stop = pen.token_ids[at]  # a token greedy, penalised decoding meets: the config's second end-of-sequence id
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "repetition_penalty": 1.5, "eos_token_id": [VOCAB - 1, stop], "do_sample": True}))
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.default_sampling_params().repetition_penalty == 1.5 and llm.default_sampling_params().greedy
    out = llm.generate([PROMPT])[0]  # the model's defaults, and its end-of-sequence ids
    assert (out.token_ids, out.finish_reason) == (pen.token_ids[:at + 1], "stop")
    sampled = {mode: llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=7,
                                                           repetition_penalty=rep))[0].token_ids
               for mode, rep in (("auto", 1.5), ("vllm", 1.0))}
    for mode in ("auto", "vllm"):
        server = LiveServer(create_app(llm, "m", generation_config=mode))
        try:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            if mode == "auto":  # greedy, penalised: the model's defaults
                assert _ids(r) == pen.token_ids
            r = httpx.post(server.url + "/v1/completions", json={**body, "temperature": 1.0, "seed": 7}, timeout=60)
            assert _ids(r) == sampled[mode]  # the request's temperature; repetition_penalty the model's, or 1
        finally:
            server.close()
    assert sampled["auto"] != sampled["vllm"] and pen.token_ids != free
