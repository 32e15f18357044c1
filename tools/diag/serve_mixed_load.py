"""Mixed load against a running `eyas serve`: N concurrent OpenAI-client requests of 14 kinds drawn at random (chat,
streamed with usage, streams the client drops after a few chunks, completions with echo, n = 2, a JSON schema,
log-probabilities, penalties, stop strings, four kinds of bad input that must get their 4xx, and a seeded request
sent twice that must sample the same text), then the server's running and waiting requests and KV blocks in use
(`/metrics`), which must all be 0. Prints the failures.

    eyas serve --model smollm2 --device cpu --port 8123 --max-num-seqs 8 &
    python tools/diag/serve_mixed_load.py [SEED] [N] [BASE_URL]

A seeded request's sample depends on the tree that verified it (docs/serving.md): under a dispatcher that picks
the tree by batch size, the "seed" kind's two answers can differ; under one speculation they must not.
"""
import asyncio
import json
import random
import sys
import urllib.request

import openai

BASE = sys.argv[3] if len(sys.argv) > 3 else "http://127.0.0.1:8123"
client = openai.AsyncOpenAI(base_url=BASE + "/v1", api_key="x", max_retries=0, timeout=300)
M = "smollm2"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
PROMPTS = ["Write a haiku about rain.", "What is 17*23?", "List three fruits.", "Explain gravity briefly.",
           "Translate 'hello' to French.", "Give me a JSON object with a and b."]
errors, results = [], []


async def one(i, rng):
    kind = rng.choice(["chat", "chat_stream", "cancel", "completion", "n2", "guided", "logprobs", "penalty", "stop",
                       "bad_temp", "bad_model", "bad_schema", "long_max", "seed"])
    msgs = [{"role": "user", "content": rng.choice(PROMPTS)}]
    try:
        if kind == "chat":
            r = await client.chat.completions.create(model=M, messages=msgs, max_tokens=rng.randint(1, 40),
                                                      temperature=rng.choice([0, 0.7, 1.0]))
            assert r.choices[0].message.content is not None
        elif kind == "chat_stream":
            s = await client.chat.completions.create(model=M, messages=msgs, max_tokens=30, stream=True,
                                                      stream_options={"include_usage": True})
            text, usage = "", None
            async for c in s:
                if c.choices and c.choices[0].delta.content:
                    text += c.choices[0].delta.content
                usage = c.usage or usage
            assert usage is not None and usage.completion_tokens > 0, usage
        elif kind == "cancel":
            s = await client.chat.completions.create(model=M, messages=msgs, max_tokens=200, stream=True)
            k = 0
            async for c in s:
                k += 1
                if k >= rng.randint(1, 6):
                    break
            await s.close()
        elif kind == "completion":
            r = await client.completions.create(model=M, prompt="Once upon a time", max_tokens=20,
                                                echo=rng.random() < .5)
            assert r.choices[0].text
        elif kind == "n2":
            r = await client.chat.completions.create(model=M, messages=msgs, max_tokens=16, n=2, temperature=0.8)
            assert len(r.choices) == 2
        elif kind == "guided":
            r = await client.chat.completions.create(model=M, messages=msgs, max_tokens=60, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
            if r.choices[0].finish_reason == "stop":
                d = json.loads(r.choices[0].message.content)
                assert "a" in d and "b" in d
        elif kind == "logprobs":
            r = await client.chat.completions.create(model=M, messages=msgs, max_tokens=12, logprobs=True,
                                                      top_logprobs=3)
            lp = r.choices[0].logprobs.content
            assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in lp)
        elif kind == "penalty":
            r = await client.chat.completions.create(model=M, messages=msgs, max_tokens=20, frequency_penalty=1.0,
                                                      presence_penalty=0.5, extra_body={"repetition_penalty": 1.3})
        elif kind == "stop":
            r = await client.chat.completions.create(model=M, messages=msgs, max_tokens=40, stop=["\n", "."])
            t = r.choices[0].message.content
            assert "\n" not in t and "." not in t, t
        elif kind == "bad_temp":
            try:
                await client.chat.completions.create(model=M, messages=msgs, temperature=-1)
                errors.append((i, kind, "accepted"))
            except openai.BadRequestError:
                pass
        elif kind == "bad_model":
            try:
                await client.chat.completions.create(model="nope", messages=msgs)
                errors.append((i, kind, "accepted"))
            except openai.NotFoundError:
                pass
        elif kind == "bad_schema":
            try:
                await client.chat.completions.create(model=M, messages=msgs, response_format={
                    "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
                errors.append((i, kind, "accepted"))
            except openai.BadRequestError:
                pass
        elif kind == "long_max":
            try:
                await client.chat.completions.create(model=M, messages=msgs, max_tokens=10**7)
                errors.append((i, kind, "accepted"))
            except openai.BadRequestError:
                pass
        elif kind == "seed":
            a = await client.chat.completions.create(model=M, messages=msgs, max_tokens=16, temperature=1.0, seed=7)
            b = await client.chat.completions.create(model=M, messages=msgs, max_tokens=16, temperature=1.0, seed=7)
            assert a.choices[0].message.content == b.choices[0].message.content, (a.choices[0].message.content,
                                                                                  b.choices[0].message.content)
        results.append(kind)
    except Exception as e:  # noqa: BLE001 - every failure is reported
        errors.append((i, kind, repr(e)[:300]))


async def main():
    rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    await asyncio.gather(*(one(i, random.Random(rng.random())) for i in range(n)))
    await asyncio.sleep(2)
    m = urllib.request.urlopen(BASE + "/metrics").read().decode()
    used = [line for line in m.splitlines()
            if line.startswith("eyas:kv_cache_used_blocks") or line.startswith("eyas:num_requests")]
    print("done", len(results), "errors", len(errors))
    for e in errors:
        print(" ", e)
    print("\n".join(used))

if __name__ == "__main__":
    asyncio.run(main())
