"""The OpenAI-compatible HTTP server: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (streaming via SSE and
not), `/v1/responses` (eyas/serve/responses.py), `/health`, `/metrics`. FastAPI + uvicorn; the engine runs in its
own thread (see async_engine.py).

    eyas serve --model smollm2 [--draft default] [--speculation tree:8] [--host 127.0.0.1] [--port 8000]

Status codes: 400 for bad values (and malformed JSON), 422 for a body that does not fit the schema (wrong types,
missing fields), 404 for an unknown model name (as OpenAI does), 503 with Retry-After when the engine is full,
500 for a bug. Every error body is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import threading
import time
from dataclasses import replace

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.engine.cuda_graph import EXTRAS_KINDS
from eyas.engine.detokenizer import TextStream
from eyas.engine.heap import freeze_heap
from eyas.loader.resolve import resolve_draft_arg
from eyas.sampling_params import MAX_LOGPROBS, GuidedDecoding, SamplingParams
from eyas.serve import responses
from eyas.serve.async_engine import AsyncEngine, EngineDead, EngineError, QueueFull
from eyas.serve.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from eyas.serve.metrics import CONTENT_TYPE, Metrics
from eyas.serve.reasoning import PARSERS as REASONING_PARSERS
from eyas.serve.reasoning import make_reasoning_parser
from eyas.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard,
                                 ModelList, TokenizeRequest, api_error_response, completion_id, error_response,
                                 make_usage)
from eyas.serve.tools import PARSERS, ToolStream, check_tools, make_parser, tool_guide

log = logging.getLogger("eyas.serve")

MAX_N = 128  # choices per request (n x prompts)
SEED_LIMIT = 1 << 63
RETRY_AFTER_S = 1


# ---- request -> engine inputs ------------------------------------------------------------------------------------

def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0].rstrip(":")
    return word if word in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs",
                            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                            "truncate_prompt_tokens", "skip_special_tokens", "min_tokens",
                            "allowed_token_ids", "prompt_logprobs", "bad_words", "priority") else None


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _guided(req) -> GuidedDecoding | None:
    """The request's guided decoding: OpenAI's `response_format` (chat) or one of vLLM's `guided_*` fields."""
    asked, params = {}, []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            asked["json_object"] = True
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError("response_format of type json_schema needs json_schema.schema, a JSON schema object",
                               param="response_format")
            asked["json"] = spec["schema"]
        elif kind == "structural_tag":  # vLLM's: {"structures", "triggers"} or {"format"} beside the type
            asked["structural_tag"] = {k: v for k, v in rf.items() if k != "type"}
        elif kind != "text":
            raise APIError("response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                           f"got {kind!r}", param="response_format")
        params.append("response_format")
    for field, key in GUIDED_FIELDS.items():
        value = getattr(req, field)
        if value is not None:
            asked[key] = value
            params.append(field)
    if len(params) > 1:
        raise APIError(f"give at most one of response_format and the guided_* fields, got {params}", param=params[1])
    if not asked:
        return None
    try:
        return GuidedDecoding(**asked)
    except ValueError as e:
        raise APIError(str(e), param=params[0]) from None


def _logit_bias(req) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (keys: token ids as strings) as SamplingParams takes it."""
    if not req.logit_bias:
        return None
    try:
        return {int(k): v for k, v in req.logit_bias.items()}
    except ValueError:
        raise APIError(f"logit_bias keys must be token ids, got {sorted(req.logit_bias)!r}",
                       param="logit_bias") from None


def _sampling_params(req, max_tokens: int | None, logprobs: int | None = None,
                     defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the model's settings for what the request leaves out (`--generation-config auto`), else
    OpenAI's."""
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
        raise APIError(f"seed must be an integer in [0, 2**63), got {req.seed}", param="seed")
    d = defaults or {}

    def given(name, fallback):
        value = getattr(req, name)
        return value if value is not None else d.get(name, fallback)
    try:
        return SamplingParams(
            temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", -1),
            min_p=given("min_p", 0.0),
            max_tokens=max(1, req.min_tokens or 0) if max_tokens is None else max_tokens,  # the real value: per prompt
            seed=req.seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens, min_tokens=req.min_tokens or 0,
            guided=_guided(req), logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias=_logit_bias(req), allowed_token_ids=req.allowed_token_ids,
            prompt_logprobs=req.prompt_logprobs, bad_words=req.bad_words, priority=req.priority)
    except ValueError as e:
        raise APIError(str(e), param=_param_of(str(e))) from None


def _tool_choice(req, parser) -> str:
    """The request's tool choice, checked: "none", "auto" (with tools, and a parser to read the calls back),
    "required", or the named function's name (`eyas.serve.tools`)."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    name = choice if isinstance(choice, str) else choice.function.name
    if not req.tools:
        if name != "none":
            raise APIError(f"tool_choice {name!r} needs tools", param="tool_choice")
        return "none"
    try:
        check_tools([t.function.name for t in req.tools])
    except ValueError as e:
        raise APIError(str(e), param="tools") from None
    if not isinstance(choice, str):
        if name not in {t.function.name for t in req.tools}:
            raise APIError(f"tool_choice names the function {name!r}, which is not among the tools",
                           param="tool_choice")
    elif name == "auto" and parser is None:
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                       '(or give tool_choice "none", "required" or a named function)', param="tool_choice")
    return name


def _with_tool_guide(req, base: SamplingParams, choice: str) -> SamplingParams:
    """`base` under the guide a named or "required" tool choice puts on the output; no other guide may be given."""
    guided = tool_guide([t.model_dump() for t in req.tools], choice, req.parallel_tool_calls) if req.tools else None
    if guided is None:
        return base
    if base.guided is not None:
        raise APIError(f"tool_choice {choice!r} guides the output itself: it does not combine with response_format "
                       "or the guided_* fields", param="tool_choice")
    try:
        return replace(base, guided=guided)
    except ValueError as e:
        raise APIError(str(e), param="tool_choice") from None


def _choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j of a request with seed s samples as an offline request with seed s + j (mod 2**63)."""
    return None if seed is None else (seed + j) % SEED_LIMIT


class _TextChunk:
    """The SSE event of one choice's text chunk, `build(text)`, with only the text encoded per chunk: the event of a
    marker text is built once and split around the marker. Encoding the whole chunk (`json.dumps` of its dict) took
    ~4 us an event on the event loop, which shares the interpreter with the engine loop; the text alone ~0.8. Where
    the marker shows elsewhere in the event (a model name holding it), every chunk is built whole."""

    MARK = "\ue000eyas-text\ue000"  # private-use characters, in no id the server makes

    def __init__(self, build):
        self.build = build
        parts = build(self.MARK).split(json.dumps(self.MARK, ensure_ascii=False))
        self.head, self.tail = parts if len(parts) == 2 else (None, None)

    def __call__(self, text: str) -> str:
        if self.head is None:
            return self.build(text)
        return f"{self.head}{json.dumps(text, ensure_ascii=False)}{self.tail}"


def _validation_response(errors) -> JSONResponse:
    """Malformed JSON -> 400; a body that does not fit the schema -> 422, naming the fields."""
    bad_json = [x for x in errors if x.get("type") == "json_invalid"]
    if bad_json:
        ctx = bad_json[0].get("ctx") or {}
        return error_response("We could not parse the JSON body of your request: "
                              f"{ctx.get('error', bad_json[0].get('msg'))}", 400)
    parts, param = [], None
    for x in errors[:5]:
        loc = [str(p) for p in x.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {x.get('msg')}")
    return error_response("Invalid request: " + "; ".join(parts), 422, param=param)


async def _parse(request: Request, model):
    """The body as `model`, whatever the Content-Type says (curl users forget it)."""
    return await _parse_body(await request.body(), model)


async def _parse_body(body: bytes, model):
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _BadBody(_validation_response(e.errors())) from None


class _BadBody(Exception):
    def __init__(self, response: JSONResponse):
        self.response = response


def _reset_prefix_cache(engine) -> int:
    """/reset_prefix_cache's work on the engine loop (a module-level function: an engine process takes it pickled)."""
    return engine.scheduler.reset_prefix_cache()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- the app -----------------------------------------------------------------------------------------------------

class Server:
    """Holds the engine loop and the metrics; the handlers of `create_app` call it."""

    def __init__(self, llm, served_model_name: str, max_queue: int, aliases: tuple[str, ...] = (),
                 tool_parser: str | None = None, chat_template: str | None = None,
                 reasoning_parser: str | None = None, stream_interval: int = 1):
        self.engine = engine = getattr(llm, "engine", llm)  # an LLM or an LLMEngine
        # splits a reasoning model's thinking from its answer (eyas.serve.reasoning); a tokenizer without the tags
        # stops the server here
        self.reasoning = None if reasoning_parser is None else make_reasoning_parser(reasoning_parser,
                                                                                     engine.tokenizer)
        self.chat_template = chat_template  # in place of the model's (`eyas serve --chat-template`)
        self.tool_parser = None if tool_parser is None else make_parser(tool_parser)  # reads "auto" tool calls
        self.sampling_defaults: dict = {}  # the model's, for what a request leaves out (`create_app`)
        self.responses = responses.ResponseStore()  # /v1/responses' stored ones (previous_response_id, GET)
        self.background: dict[str, tuple] = {}  # background responses at work: id -> (their task, request ids)
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.names = {served_model_name, *aliases}
        self.metrics = Metrics(served_model_name)
        # the engine loop: a thread of this process, or the loop of an engine in a process of its own
        # (`eyas.serve.core_client.EngineProcess`, whose `make_loop` gives it)
        self.async_engine = (engine.make_loop(self.metrics, max_queue, stream_interval)
                             if hasattr(engine, "make_loop") else
                             AsyncEngine(engine, self.metrics, max_queue=max_queue, stream_interval=stream_interval))
        self.max_model_len = engine.max_model_len
        self._grammar = None
        self._token_texts: dict[int, str] = {}
        if self.tokenizer is not None and hasattr(engine, "grammar_backend"):
            # guided decoding's tokenizer view takes ~1 s to make: made now, beside startup, not at the first
            # guided request (it would hold up the engine loop, and every stream with it)
            self._grammar = threading.Thread(target=self._backend, name="eyas-grammar-warmup", daemon=True)
            self._grammar.start()

    def wait_for_warmup(self) -> None:
        """Until guided decoding's warm-up is done (`eyas serve` waits so before it serves: the warm-up imports
        xgrammar, and with it transformers, for seconds of this process's CPU, which the first requests would share
        with it, and its objects would stay out of the frozen heap)."""
        if self._grammar is not None:
            self._grammar.join()

    def token_text(self, token_id: int) -> str:
        """A token's own text, as `logprobs` name tokens (eyas.serve.logprobs); kept once made."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = (f"token_id:{token_id}" if self.tokenizer is None else
                                                  self.tokenizer.decode([token_id], skip_special_tokens=False))
        return text

    def _backend(self):
        try:
            return self.engine.grammar_backend()
        except Exception as e:  # noqa: BLE001 - a guided request will meet the same error and report it
            log.warning("guided decoding is unavailable: %s", e)
            return None

    async def compile_guided(self, guided) -> None:
        """Compile a request's guide off the event loop and the engine loop (xgrammar caches it for the engine's
        own compile): a schema, regex or grammar it refuses is a 400 before anything is queued."""
        if guided is None:
            return
        if not hasattr(self.engine, "grammar_backend"):
            raise APIError("guided decoding is not available on this engine", param="response_format")
        try:
            await asyncio.to_thread(lambda: self.engine.grammar_backend().compile(guided))
        except ValueError as e:
            raise APIError(str(e)) from None

    # ---- validation -----------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(f"The model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in sorted(self.names))}.", status=404, param="model",
                           code="model_not_found")

    def prompt_ids(self, prompt, param: str, truncate: int | None = None) -> list[int]:
        """The prompt's token ids; its last `truncate` only, where given (`truncate_prompt_tokens`)."""
        try:
            ids = self.engine.encode(prompt)
        except ValueError as e:
            raise APIError(str(e), param=param) from None
        return ids if truncate is None else ids[-truncate:]

    def chat_text(self, req) -> str:
        """A request's `messages` through the chat template (/v1/chat/completions and /tokenize), with its
        `add_generation_prompt` and `continue_final_message`."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template: use /v1/completions with token ids",
                           param="messages")
        template = req.chat_template or self.chat_template
        if template is None and not self.tokenizer.chat_template:
            raise APIError("this model has no chat template: start the server with --chat-template, give "
                           "chat_template, or use /v1/completions", param="messages")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError("continue_final_message needs add_generation_prompt: false", param="continue_final_message")
        messages = [m.template_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      continue_final_message=req.continue_final_message, tools=tools,
                                                      chat_template=template, **(req.chat_template_kwargs or {}))
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            param = "chat_template" if req.chat_template else (
                "chat_template_kwargs" if req.chat_template_kwargs else "messages")
            raise APIError(f"could not apply the chat template: {e}", param=param) from None

    def fit(self, ids: list[int], max_tokens: int | None, param: str, max_param: str) -> int:
        """The output budget of one prompt: max_tokens, or the rest of the context when None."""
        L, P = self.max_model_len, len(ids)
        if P >= L:
            raise APIError(f"This model's maximum context length is {L} tokens, but the prompt has {P} tokens "
                           "(prompt and output must fit). Please shorten the prompt.", param=param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return L - P
        if max_tokens < 1:
            raise APIError(f"{max_param} must be an integer >= 1, got {max_tokens}", param=max_param)
        if P + max_tokens > L:
            raise APIError(f"This model's maximum context length is {L} tokens. However, you requested "
                           f"{P + max_tokens} tokens ({P} in the prompt, {max_tokens} in the completion). "
                           f"Please reduce the length of the prompt or {max_param}.", param=max_param,
                           code="context_length_exceeded")
        return max_tokens

    def common_checks(self, req) -> None:
        self.check_model(req.model)
        if not 1 <= req.n <= MAX_N:
            raise APIError(f"n must be an integer in [1, {MAX_N}], got {req.n}", param="n")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError("prompt_logprobs is not supported with stream (completions' echo with logprobs streams "
                           "the prompt's)", param="prompt_logprobs")

    # ---- submission -----------------------------------------------------------------------------------------
    async def submit(self, prefix: str, prompts: list[list[int]], budgets: list[int], base: SamplingParams,
                     n: int, arrival: float):
        if len(prompts) * n > MAX_N:
            raise APIError(f"at most {MAX_N} choices per request (prompts x n), got {len(prompts) * n}", param="n")
        items = []
        for p, (ids, budget) in enumerate(zip(prompts, budgets)):
            for j in range(n):
                params = replace(base, max_tokens=budget, seed=_choice_seed(base.seed, j))
                items.append((f"{prefix}-{p * n + j}", list(ids), params))
        try:
            queue = await self.async_engine.add(items, arrival)
        except QueueFull as e:
            raise APIError(str(e), status=503, type="server_error", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDead as e:
            raise APIError(str(e), status=503, type="server_error", code="engine_dead") from None
        except EngineError as e:
            raise APIError(str(e), status=500, type="server_error") from None
        except ValueError as e:
            raise APIError(str(e), param=_param_of(str(e))) from None
        return queue, [rid for rid, _, _ in items]

    async def collect(self, request: Request, queue, ids: list[str]) -> dict:
        """Non-streaming: wait for every choice, aborting them if the client disconnects meanwhile."""
        finals: dict = {}

        async def run():
            async for idx, out in AsyncEngine.results(queue, len(ids)):
                if out.finished:
                    finals[idx] = out

        task = asyncio.ensure_future(run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    break
                if await request.is_disconnected():
                    log.info("client disconnected: aborting %d request(s)", len(ids))
                    raise APIError("the client closed the connection", status=499, code="client_closed_request")
            try:
                task.result()
            except EngineError as e:
                raise APIError(str(e), status=500, type="server_error") from None
            return finals
        finally:
            if not task.done():
                task.cancel()
            self.async_engine.abort(ids)  # no-op for the finished ones


OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without the API key (probes and scrapers)


def create_app(llm, served_model_name: str | None = None, max_queue: int = 256,
               aliases: tuple[str, ...] = (), tool_parser: str | None = None,
               chat_template: str | None = None, api_key: str | None = None,
               generation_config: str = "auto", reasoning_parser: str | None = None,
               stream_interval: int = 1) -> FastAPI:
    """`llm`: an `eyas.LLM` (or an `LLMEngine`). The engine thread starts and stops with the app's lifespan.
    `tool_parser`: how "auto" tool calls are read from the text (`eyas.serve.tools.PARSERS`); None refuses them.
    `chat_template`: a Jinja template in place of the model's (a request's own `chat_template` goes first).
    `api_key`: when set, every endpoint but `OPEN_PATHS` wants `Authorization: Bearer <api_key>` (401 otherwise).
    `generation_config`: "auto" (vLLM's default): what a request leaves out of temperature, top_p, top_k, min_p and
    repetition_penalty comes from the model's generation_config.json where it has them; "vllm": OpenAI's defaults
    always. `reasoning_parser` (`eyas.serve.reasoning.PARSERS`): a reasoning model's thinking comes back apart from
    its answer, and guides apply to the answer only; ValueError where the tokenizer lacks its tags.
    `stream_interval`: a request's outputs reach its handler once per that many tokens (the first and the last at
    once): fewer, larger stream chunks, for less of this process's work a token (`eyas.serve.async_engine.dispatch`).
    """
    if generation_config not in ("auto", "vllm"):
        raise ValueError(f"generation_config must be 'auto' or 'vllm', got {generation_config!r}")
    server = Server(llm, served_model_name or "smollm2", max_queue, aliases, tool_parser, chat_template,
                    reasoning_parser, stream_interval)
    if generation_config == "auto":
        server.sampling_defaults = server.engine.target.config.generation_defaults or {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            for task, _ in list(server.background.values()):  # background responses still at work
                task.cancel()
            server.async_engine.shutdown()

    app = FastAPI(title="eyas", description="OpenAI-compatible server of eyas", lifespan=lifespan)
    app.state.server = server

    if api_key:
        import secrets
        want = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _authorize(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path in OPEN_PATHS or secrets.compare_digest(given, want):
                return await call_next(request)
            return error_response("Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key the "
                                  "server was started with (--api-key)", 401, code="invalid_api_key")

    # ---- errors ---------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return api_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return _validation_response(e.errors())

    @app.exception_handler(_BadBody)
    async def _bad_body(request, e: _BadBody):
        return e.response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(str(e.detail), e.status_code, code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        log.exception("internal error")
        return error_response(f"internal server error: {e!r}", 500, type="server_error")

    # ---- routes ---------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not server.async_engine.alive:
            return error_response("the engine loop is not running", 503, type="server_error")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from eyas import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    def card(name):
        return ModelCard(id=name, root=server.model_name, max_model_len=server.max_model_len)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[card(n) for n in sorted(server.names)]).model_dump()

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        server.check_model(name)
        return card(name).model_dump()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached KV block (vLLM's endpoint of the same name): cold-start timings without a restart."""
        from eyas.engine.engine import LLMEngine
        from eyas.serve.core_client import EngineLink
        if not isinstance(server.engine, (LLMEngine, EngineLink)):  # TP ranks must stay in step; two engines
            raise APIError("reset_prefix_cache is only available on a single engine (no --tensor-parallel or "
                           "--disaggregate)")
        n = await server.async_engine.call(_reset_prefix_cache)
        return {"reset": True, "blocks": n}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: the token ids the engine would read for a prompt, or for chat messages through the chat template
        (`add_generation_prompt`, default true, as /v1/chat/completions applies it)."""
        req = await _parse(request, TokenizeRequest)
        if req.model is not None:
            server.check_model(req.model)
        tok = server.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer: its prompts are token ids already", param="prompt")
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        # a chat's template writes any BOS itself (vLLM and HF tokenize it without special tokens)
        special = req.add_special_tokens if req.add_special_tokens is not None else req.messages is None
        ids = tok.encode(req.prompt if req.messages is None else server.chat_text(req), add_bos=special)
        out = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [server.token_text(i) for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: token ids back to text (special tokens kept)."""
        req = await _parse(request, DetokenizeRequest)
        if req.model is not None:
            server.check_model(req.model)
        if server.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        V = server.tokenizer.vocab_size
        if not all(0 <= t < V for t in req.tokens):
            raise APIError(f"tokens must be token ids in [0, {V})", param="tokens")
        return {"prompt": _decode(server, req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        req = await _parse(request, CompletionRequest)
        server.common_checks(req)
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of is not supported (only best_of == n)", param="best_of")
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            prompts = [p]
        elif isinstance(p, list) and p:
            prompts = list(p)
        else:
            raise APIError("the prompt is empty", param="prompt")
        # `echo` with `max_tokens: 0` (OpenAI's legacy way to score a text): one token is generated and dropped
        score_only = req.echo and req.max_tokens == 0
        asked = 1 if score_only else req.max_tokens
        base = _sampling_params(req, asked, req.logprobs, server.sampling_defaults)
        names = _token_names(server, req)
        if req.echo and req.logprobs is not None and base.prompt_logprobs is None:  # the prompt's tokens get theirs
            base = dataclasses.replace(base, prompt_logprobs=req.logprobs)  # too (lm-eval's loglikelihood)
        await server.compile_guided(base.guided)
        max_tokens = 16 if asked is None else asked  # OpenAI's default for completions
        ids = [server.prompt_ids(x, "prompt", base.truncate_prompt_tokens) for x in prompts]
        budgets = [server.fit(x, max_tokens, "prompt", "max_tokens") for x in ids]
        cid = completion_id("cmpl")
        queue, rids = await server.submit(cid, ids, budgets, base, req.n, arrival)
        num_prompt = sum(len(x) for x in ids)
        # echo: each choice's prompt, as given (a list of ids: decoded), and its ids
        echoes = [(x if isinstance(x, str) else _decode(server, x), y) for x, y in zip(prompts, ids)
                  for _ in range(req.n)] if req.echo else None
        if req.stream:
            include_usage = _usage_mode(req)
            return _stream(server, queue, rids, cid, req.model, "text_completion", num_prompt, include_usage,
                           base.stop, req.n, echoes=echoes, score_only=score_only, names=names)
        finals = await server.collect(request, queue, rids)
        choices = []
        for i in range(len(rids)):
            out, echo = finals[i], echoes[i] if echoes else None
            if score_only:
                choices.append({"index": i, "text": echo[0], "finish_reason": "length",
                                "logprobs": _logprobs(names, out, False, echo=echo, prompt_only=True)})
            else:
                choices.append({"index": i, "text": (echo[0] if echo else "") + out.text,
                                "finish_reason": out.finish_reason,
                                "logprobs": _logprobs(names, out, False, echo=echo)})
            if req.prompt_logprobs is not None:  # vLLM's field, beside OpenAI's logprobs
                choices[-1]["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs, ids[i // req.n],
                                                                 names)
        completion_tokens = 0 if score_only else sum(len(o.token_ids) for o in finals.values())
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": req.model,
                "choices": choices, "usage": make_usage(num_prompt, completion_tokens, _cached(finals, req.n))}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        req = await _parse(request, ChatCompletionRequest)
        ids, base, cid, queue, rids, calls, _ = await _submit_chat(server, req, arrival, "chatcmpl")
        names = _token_names(server, req)
        if req.stream:
            include_usage = _usage_mode(req)
            return _stream(server, queue, rids, cid, req.model, "chat.completion.chunk", len(ids), include_usage,
                           base.stop, req.n, calls, names=names)
        finals = await server.collect(request, queue, rids)
        choices = []
        for i in range(len(rids)):
            out = finals[i]
            message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
            if calls is not None:
                message, finish = calls().message(out.text, finish)
            choices.append({"index": i, "message": message, "logprobs": _logprobs(names, out, True),
                            "finish_reason": finish})
        reply = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
                 "choices": choices,
                 "usage": make_usage(len(ids), sum(len(o.token_ids) for o in finals.values()),
                                     _cached(finals, req.n))}
        if req.prompt_logprobs is not None:  # vLLM's: the prompt's, once (every choice reads the same prompt)
            reply["prompt_logprobs"] = prompt_logprobs(finals[0].prompt_logprobs, ids, names)
        return reply

    @app.post("/v1/responses")
    async def create_response(request: Request):
        arrival = time.perf_counter()
        body = await request.body()
        rreq = await _parse_body(body, responses.ResponsesRequest)  # so the body is a JSON object
        raw = json.loads(body)
        history = []
        if rreq.previous_response_id is not None:
            before, history = server.responses.get(rreq.previous_response_id, "previous_response_id")
            if before["status"] in ("queued", "in_progress"):
                raise APIError(f"response {rreq.previous_response_id!r} is still {before['status']}: continue it once "
                               "it has ended", param="previous_response_id")
        chat, messages = responses.chat_body(rreq, raw, history)
        inputs = messages[len(history):]  # the response's own input (its input items)
        try:
            req = ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            raise _BadBody(_validation_response(e.errors())) from None
        ids, base, _, queue, rids, calls, thinking = await _submit_chat(server, req, arrival, "resp")
        rid, created = responses.new_id(), responses.now()
        names = _token_names(server, req)
        if rreq.stream:
            return _response_stream(server, rreq, rid, created, queue, rids, len(ids), base.stop, calls, messages,
                                    names, thinking, inputs)

        def made(out) -> dict:  # the response of a finished output
            message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
            if calls is not None:
                message, finish = calls().message(out.text, finish)
            status = responses.status_of(finish)
            lp = _logprobs(names, out, True)
            thought = _thought_tokens(server, out.token_ids, thinking)
            return responses.response(rid, rreq, created,
                                      responses.output_items(message, status, lp and lp["content"][thought:]),
                                      status, responses.usage(len(ids), len(out.token_ids), out.num_cached_tokens,
                                                              thought))
        if rreq.background:  # answered now, "queued"; the stored response moves on as the engine works
            resp = responses.response(rid, rreq, created, [], "queued", None)
            server.responses.put(resp, messages, inputs)
            task = asyncio.ensure_future(_background(server, resp, queue, rids, made, messages))
            server.background[rid] = (task, rids)
            return resp
        resp = made((await server.collect(request, queue, rids))[0])
        if rreq.store:
            server.responses.put(resp, messages, inputs)
        return resp

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        return server.responses.get(rid)[0]

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        _stop_background(server, rid)
        return server.responses.delete(rid)

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel_response(rid: str):
        """Stop a background response still queued or in progress ("cancelled"); one that has ended comes back as it
        is. Only background responses can be cancelled (a 400)."""
        resp = server.responses.get(rid)[0]
        if not resp.get("background"):
            raise APIError("only background responses can be cancelled", param="response_id")
        if _stop_background(server, rid):
            resp["status"] = "cancelled"
        return resp

    @app.get("/v1/responses/{rid}/input_items")
    async def list_input_items(rid: str, order: str = "desc", limit: int = 20, after: str | None = None):
        return server.responses.input_items(rid, order, limit, after)

    return app


async def _submit_chat(server: Server, req, arrival: float, prefix: str):
    """A chat request checked and queued: (its prompt ids, sampling parameters, id, queue, request ids, the maker of
    each choice's reply stream (a `ToolStream` with tools, inside a `ReasoningStream` with a reasoning parser; None
    for neither), and whether the output starts in a reasoning model's thinking (None without a parser))."""
    server.common_checks(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                       param="top_logprobs")
    tool_choice = _tool_choice(req, server.tool_parser)
    text = server.chat_text(req)
    max_tokens, max_param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    base = _sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                            server.sampling_defaults)
    base = _with_tool_guide(req, base, tool_choice)
    await server.compile_guided(base.guided)
    ids = server.prompt_ids(server.tokenizer.encode(text, add_bos=req.add_special_tokens),  # the template's BOS
                            "messages", base.truncate_prompt_tokens)
    budget = server.fit(ids, max_tokens, "messages", max_param)
    thinking = None if server.reasoning is None else server.reasoning.thinking(ids, req.chat_template_kwargs)
    if thinking and base.guided is not None:  # the guide holds the answer: its grammar starts after the thinking
        base = replace(base, guided=replace(base.guided, after_token_id=server.reasoning.end_id))
    cid = completion_id(prefix)
    queue, rids = await server.submit(cid, [ids], [budget], base, req.n, arrival)
    tools = None if tool_choice == "none" else lambda: ToolStream(tool_choice, server.tool_parser)
    calls = tools
    if thinking is not None:
        calls = lambda: server.reasoning.stream(thinking, tools() if tools is not None else None,  # noqa: E731
                                                req.include_reasoning)
    return ids, base, cid, queue, rids, calls, thinking


def _thought_tokens(server: Server, ids: list[int], thinking: bool | None) -> int:
    """How many of an output's tokens are a reasoning model's thinking (0 without a reasoning parser)."""
    return 0 if thinking is None else server.reasoning.reasoning_tokens(list(ids), thinking)


def _stop_background(server: Server, rid: str) -> bool:
    """Stop a background response still at work (its task cancelled, its request aborted: its blocks freed);
    whether one was."""
    running = server.background.pop(rid, None)
    if running is None:
        return False
    task, rids = running
    task.cancel()
    server.async_engine.abort(rids)
    return True


async def _background(server: Server, resp: dict, queue, rids: list[str], made, messages: list[dict]) -> None:
    """A background response's work: "in_progress" from its first output, then stored whole when it ends
    ("completed" or "incomplete"), or "failed" with the error where the engine failed it. A cancel or a delete
    cancels this task (and aborts the request)."""
    rid = resp["id"]
    try:
        final = None
        async for _, out in AsyncEngine.results(queue, 1):
            resp["status"] = "in_progress"
            if out.finished:
                final = out
        done = made(final)
        done["created_at"] = resp["created_at"]
        if server.background.get(rid) is not None:  # not cancelled or deleted meanwhile
            server.responses.put(done, messages)
    except EngineError as e:
        resp.update(status="failed", error={"code": "server_error", "message": str(e)})
    finally:
        server.background.pop(rid, None)
        server.async_engine.abort(rids)


def _response_stream(server: Server, rreq, rid: str, created: int, queue, rids: list[str], num_prompt: int,
                     stops: list[str], calls, messages: list[dict], names,
                     thinking: bool | None = None, inputs: list[dict] | None = None) -> StreamingResponse:
    """/v1/responses with stream: OpenAI's typed events (`eyas.serve.responses.ResponseEvents`), the response
    stored at the end as the non-streaming path stores it."""
    ev = responses.ResponseEvents(rid, rreq, created)

    async def events():
        text, tools = TextStream(stops), calls() if calls is not None else None
        try:
            for e in ev.start():
                yield e
            async for _, out in AsyncEngine.results(queue, 1):
                delta = text.delta(out)
                lp = None
                if out.logprobs is not None and out.new_token_ids:  # no tools here; the answer's tokens only
                    first = len(out.token_ids) - len(out.new_token_ids)
                    skip = max(0, _thought_tokens(server, out.token_ids, thinking) - first)
                    lp = _logprobs(names, out, True, new=True)["content"][skip:] or None
                for d in (tools.feed(delta) if tools is not None else ([{"content": delta}] if delta else [])):
                    with_lp = lp if "content" in d else None  # the step's log-probabilities ride with its text
                    lp = None if with_lp is not None else lp
                    for e in ev.delta(d, with_lp):
                        yield e
                if lp is not None:  # text held back (a stop string's beginning): they come alone
                    for e in ev.delta({"content": ""}, lp):
                        yield e
                if out.finished:
                    finish = out.finish_reason
                    if tools is not None:
                        parts, finish = tools.finish(finish)
                        for d in parts:
                            for e in ev.delta(d):
                                yield e
                    closing, resp = ev.finish(finish, responses.usage(
                        num_prompt, len(out.token_ids), out.num_cached_tokens,
                        _thought_tokens(server, out.token_ids, thinking)))
                    if rreq.store:
                        server.responses.put(resp, messages, inputs)
                    for e in closing:
                        yield e
        except EngineError as e:
            yield ev.event("error", message=str(e), code=None, param=None)
        finally:
            server.async_engine.abort(rids)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _token_names(server: Server, req):
    """How a request's log-probabilities name tokens: by their text, or as "token_id:<id>" (vLLM's
    `return_tokens_as_token_ids`, for clients that must map them back to ids exactly)."""
    if getattr(req, "return_tokens_as_token_ids", False):
        return lambda i: f"token_id:{i}"
    return server.token_text


def _logprobs(names, out, chat: bool, new: bool = False, offset: int = 0,
              echo: tuple[str, list[int]] | None = None, prompt_only: bool = False) -> dict | None:
    """A choice's `logprobs` field: every output token's (`new`: those of the step's new tokens), or None; `names`
    (`_token_names`): a token id's name there. `echo` (completions): (the prompt's text, its ids), whose tokens come
    first, the first with no log-probability; with `prompt_only` (`max_tokens: 0`), theirs alone."""
    entries = out.new_logprobs if new else out.logprobs
    if entries is None:
        return None
    ids = out.new_token_ids if new else out.token_ids
    if chat:
        return chat_logprobs(entries, ids, names)
    if echo is None:
        return completion_logprobs(entries, ids, names, offset)
    head = completion_logprobs([None] + list(out.prompt_logprobs), echo[1], names)
    if prompt_only:
        return head
    tail = completion_logprobs(entries, ids, names, len(echo[0]))
    return {k: head[k] + tail[k] for k in head}


def _decode(server: Server, ids: list[int]) -> str:
    """A prompt given as token ids, as text (echo): the tokenizer's decoding, or the ids' names without one."""
    if server.tokenizer is None:
        return "".join(server.token_text(t) for t in ids)
    return server.tokenizer.decode(ids, skip_special_tokens=False)


def _cached(outs: dict, n: int) -> int:
    """Usage's `cached_tokens`: each prompt's tokens found in the prefix cache, as its first choice found them
    (choice i is prompt i // n's: `Server.submit`)."""
    return sum(o.num_cached_tokens for i, o in outs.items() if i % n == 0)


def _usage_mode(req) -> bool | str:
    """A stream's usage: False; True (`stream_options.include_usage`: a last chunk with it, the others `null`);
    "continuous" (vLLM's `continuous_usage_stats` beside it: every chunk with the usage so far)."""
    opts = req.stream_options
    if not (opts and opts.include_usage):
        return False
    return "continuous" if opts.continuous_usage_stats else True


def _stream(server: Server, queue, rids: list[str], cid: str, model: str, obj: str, num_prompt: int,
            include_usage: bool | str, stops: list[str], per_prompt: int, calls=None, echoes=None,
            score_only: bool = False, names=None) -> StreamingResponse:
    """SSE: one chunk per new text of a choice, a finish chunk per choice, the usage chunk when asked for (every
    chunk with the usage so far where `include_usage` is "continuous": `_usage_mode`), then `data: [DONE]`. A
    client that goes away cancels this generator: its requests are aborted (KV blocks freed).
    `per_prompt`: the choices of each prompt (the request's n). `calls` (chat with a tool choice): makes each
    choice's `ToolStream`, which turns its text into content and tool-call deltas. `echoes` (completions' echo):
    each choice's (prompt text, prompt ids), sent first, with the prompt's log-probabilities where asked;
    `score_only` (echo with `max_tokens: 0`): that alone, then the finish."""
    created = int(time.time())
    names = names or server.token_text
    chat = obj == "chat.completion.chunk"
    n = len(rids)
    continuous = include_usage == "continuous"
    completion_tokens = [0] * n  # each choice's so far

    def chunk(choices, usage=None):
        c = {"id": cid, "object": obj, "created": created, "model": model, "choices": choices}
        if include_usage:
            c["usage"] = usage if usage is not None or not continuous else make_usage(num_prompt,
                                                                                    sum(completion_tokens))
        return _sse(c)

    def choice(i, text=None, finish=None, role=False, logprobs=None, delta=None):
        if chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    text_chunks = [_TextChunk(lambda text, i=i: chunk([choice(i, text)])) for i in range(n)]

    async def events():
        texts = [TextStream(stops) for _ in range(n)]
        tools = [calls() for _ in range(n)] if calls is not None else None
        cached: dict[int, object] = {}
        offsets = [0] * n  # /v1/completions' logprobs: text_offset of each choice's next token
        echoed: set[int] = set()
        try:
            if chat:
                for i in range(n):
                    yield chunk([choice(i, "", role=True)])
            async for i, out in AsyncEngine.results(queue, n):
                completion_tokens[i] = 0 if score_only else out.num_output_tokens
                cached[i] = out
                if echoes is not None and i not in echoed:  # the prompt first, scored as the whole reply scores it
                    echoed.add(i)
                    lp = None
                    if out.logprobs is not None:
                        lp = _logprobs(names, out, False, echo=echoes[i], prompt_only=True)
                        offsets[i] = len(echoes[i][0])
                    yield chunk([choice(i, echoes[i][0], logprobs=lp)])
                if score_only:
                    if out.finished:
                        yield chunk([choice(i, "", finish="length")])
                    continue
                delta = texts[i].delta(out)
                if tools is not None:  # text -> content and tool-call deltas; the step's log-probabilities ride
                    parts = tools[i].feed(delta)  # with the first
                    lp = _logprobs(names, out, chat, new=True) if out.logprobs is not None and (
                        out.new_token_ids or delta) else None
                    for k, d in enumerate(parts or ([{}] if lp is not None else [])):
                        yield chunk([choice(i, delta=d, logprobs=lp if k == 0 else None)])
                    if out.finished:
                        parts, finish = tools[i].finish(out.finish_reason)
                        for d in parts:
                            yield chunk([choice(i, delta=d)])
                        yield chunk([choice(i, finish=finish)])
                    continue
                if out.logprobs is not None:  # the step's tokens' log-probabilities ride with its text
                    if out.new_token_ids or delta:
                        lp = _logprobs(names, out, chat, new=True, offset=offsets[i])
                        if not chat:
                            offsets[i] += sum(len(t) for t in lp["tokens"])
                        yield chunk([choice(i, delta, logprobs=lp)])
                elif delta:
                    yield chunk([choice(i, delta)]) if continuous else text_chunks[i](delta)
                if out.finished:
                    yield chunk([choice(i, None if chat else "", finish=out.finish_reason)])
            if include_usage:
                yield chunk([], make_usage(num_prompt, sum(completion_tokens), _cached(cached, per_prompt)))
            yield "data: [DONE]\n\n"
        except EngineError as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            yield "data: [DONE]\n\n"
        finally:
            server.async_engine.abort(rids)  # a no-op for finished requests; frees the rest on a disconnect

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- command line ------------------------------------------------------------------------------------------------

def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn)",
                              description="OpenAI-compatible server: /v1/models, /v1/completions, "
                                          "/v1/chat/completions, /v1/responses, /health, /metrics")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond the running batch at most; more get 503 with Retry-After")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="shard the target over N ranks (N GPUs with NCCL; gloo on the CPU), spawned by this command; "
                        "rank 0 serves HTTP and schedules")
    p.add_argument("--tp-draft", choices=["sharded", "replicated"], default="sharded",
                   help="with --tensor-parallel: the draft sharded like the target, or whole on every rank")
    p.add_argument("--api-key", default=None,
                   help="every endpoint but /health, /metrics and /version wants 'Authorization: Bearer KEY' "
                        "(default: $EYAS_API_KEY; none: no key asked for)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="a stream's chunk once per N tokens, the first token's and the last at once (SGLang's and "
                        "vLLM's option): less of the server's CPU a token at many streams, a coarser stream")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="N HTTP processes on the one port, sharing one engine process (vLLM's option; "
                        "eyas.serve.api_servers): at many streams one process's event loop sets the pace; the "
                        "metrics are summed over them, stored /v1/responses stay in the process that made them")
    p.set_defaults(func=run_serve)
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, engine and API options that `eyas serve` and `eyas run-batch` share."""
    p.add_argument("--model", default="smollm2", help="'smollm2', an HF directory or a .gguf file")
    p.add_argument("--draft", default="auto",
                   help="EAGLE draft directory, 'default' (the draft shipped for smollm2), 'ngram' or "
                        "'ngram:N_MIN:N_MAX' (prompt lookup: no draft model), 'none', or 'auto' "
                        "(default: the shipped draft when there is one, so speculation is on)")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter directory, merged into the model's weights at load")
    p.add_argument("--speculation", default=None,
                   help="chain:K | tree:NAME (mc_sim_7b_63, 8, 16, smollm2_25|48d5|64|128) | tree JSON file | "
                        "dispatch:B1=SPEC,B2=SPEC,... (a tree per batch size; SPEC may be 'plain') "
                        "(default with a draft: the draft's own choice for the device, else chain:3)")
    from eyas.spec.draft_quant import add_draft_quant_arg
    add_draft_quant_arg(p)
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    p.add_argument("--max-prefill-seqs", type=int, default=None,
                   help="requests a prefill step takes at most; 0: no limit (default: with CUDA graphs, the prefill "
                        "graphs' largest batch, 16, so that a wave of arrivals prefills from graphs, not eagerly)")
    p.add_argument("--prefill-wait-ms", type=float, default=0.0, metavar="MS",
                   help="while requests decode, a new one waits up to MS for others to share its prefill step (each "
                        "prefill step stalls every stream): more tokens/s at many streams for a longer TTFT; 0: none")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: a request's unset temperature, top_p, top_k, min_p and repetition_penalty come from "
                        "the model's generation_config.json (vLLM's default); vllm: OpenAI's defaults always")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: by arrival; priority: by each request's `priority` (lower first), then arrival, "
                        "lower-priority running requests preempted for higher ones (vLLM's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt whole (default: full KV blocks outlive their request, and a prompt that "
                        "begins with the same tokens reuses them: eyas.cache.prefix_cache)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly on a GPU (default: CUDA graphs, all captured at start-up)")
    p.add_argument("--capture-extras", nargs="+", default=[], choices=sorted(EXTRAS_KINDS),
                   help="also capture at start-up the decode graphs of steps in which a request asks for "
                        "log-probabilities, penalties, or both (default: captured when a batch first needs them, "
                        "0.2-0.8 s in its requests' path on an H100; ahead, they lengthen the start-up)")
    p.add_argument("--disaggregate", default=None, metavar="PREFILL_DEVICE,DECODE_DEVICE",
                   help="prefill on one device and decode on another (e.g. cuda:0,cuda:1; eyas.engine.disagg): "
                        "decode steps do not wait for prefills; --device is not used")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine and its loop in a process of their own (vLLM V1's engine core; "
                        "eyas.serve.engine_core), away from the HTTP side's share of the GIL: at many streams the "
                        "handlers' CPU otherwise lengthens every engine step (default: on a GPU, unless "
                        "--tensor-parallel, --disaggregate or --prefill-process; --no-engine-process keeps the loop "
                        "in the server's process)")
    p.add_argument("--prefill-process", action="store_true",
                   help="with --disaggregate: the prefill engine in a process of its own, not on a thread of the "
                        "server's (eyas.engine.prefill_process)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template in place of the model's: a file, or the template itself (vLLM's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): the model\'s text is read back for tool calls '
                        "by --tool-call-parser (eyas.serve.tools); without it only 'none', 'required' and named "
                        "tool choices are served")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="how tool calls are written in the model's text: hermes (<tool_call>{...}</tool_call>: "
                        "Hermes, Qwen, SmolLM3), llama3_json (Llama 3.1-3.3's JSON) or mistral ([TOOL_CALLS][...])")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="a reasoning model's thinking (<think>...</think>) comes back as the reply's `reasoning` apart "
                        "from its content, and guides (response_format, tool choices) apply after it: deepseek_r1 "
                        "(DeepSeek-R1 and its distills, QwQ) or qwen3 (eyas.serve.reasoning)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _engine_kwargs(args) -> dict:
    """The engine settings (`EngineConfig` keywords) of `eyas serve`'s options."""
    kwargs = dict(max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                  cuda_graphs="auto" if args.cuda_graphs else False,
                  prefix_caching=getattr(args, "prefix_caching", True),
                  scheduling_policy=getattr(args, "scheduling_policy", "fcfs"))
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if getattr(args, "max_prefill_seqs", None) is not None:
        kwargs["max_prefill_seqs"] = args.max_prefill_seqs
    if getattr(args, "prefill_wait_ms", 0.0):
        kwargs["prefill_wait_ms"] = args.prefill_wait_ms
    if args.num_blocks is not None:
        kwargs["num_blocks"] = args.num_blocks
    return kwargs


def llm_kwargs(args) -> dict:
    """What `eyas.LLM` takes, from the command line."""
    return dict(model=args.model, device=args.device, dtype=args.dtype, draft=resolve_draft_arg(args.model, args.draft),
                speculation=args.speculation, draft_quant=getattr(args, "draft_quant", None),
                disaggregate=getattr(args, "disaggregate", None), lora=getattr(args, "lora", None),
                prefill_process=getattr(args, "prefill_process", False), **_engine_kwargs(args))


def build_llm(args):
    from eyas import LLM
    return LLM(**llm_kwargs(args))


def start_engine_process(args, clients: int = 1):
    """The engine of `args` in a process of its own, its graphs captured there (`--engine-process`), for `clients`
    HTTP processes (`--api-server-count`)."""
    from eyas.serve.core_client import EngineProcess
    return EngineProcess(llm_kwargs(args), _Capture(args.max_num_seqs, tuple(args.capture_extras)), args.log_level,
                         clients=clients)


def serve_app(llm, args, options: dict, sock: socket.socket | None = None, announce: bool = True) -> None:
    """`create_app(llm)` with the command line's name, queue and `options` (`_app_options`), served until stopped
    (`_serve_app`)."""
    app = create_app(llm, args.served_model_name or args.model, max_queue=args.max_queue, **options)
    _serve_app(app, getattr(llm, "engine", llm), args, sock, announce)


@dataclasses.dataclass(frozen=True)
class _Capture:
    """`_capture_graphs` with the command line's sizes: an engine process's `prepare` (pickled)."""
    max_num_seqs: int
    extras: tuple[str, ...]

    def __call__(self, engine) -> None:
        _capture_graphs(engine, self.max_num_seqs, self.extras)


def _capture_graphs(engine, max_num_seqs: int, extras: list[str] = ()) -> None:
    graphs = engine.runner.graphs
    if graphs is not None:  # every batch size the server can see, before the first request (as vLLM does)
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        with tqdm(desc="capturing CUDA graphs", unit="graph", total=0, mininterval=1.0) as bar:
            n = graphs.capture_all(max_num_seqs, extras=tuple(EXTRAS_KINDS[e] for e in extras), progress=bar)
            # and the prefills' padded shapes, without a cached prefix and after one (a shared system prompt, a
            # chat's next turn), so that no request pays a capture
            prefills, cfg = getattr(engine.runner, "prefill_graphs", None), getattr(engine, "config", None)
            if prefills is not None and cfg is not None:
                n += prefills.capture_all(max_num_seqs, min(cfg.max_num_batched_tokens, engine.max_model_len), bar)
        log.info("captured %d CUDA graphs in %.1f s", n, time.perf_counter() - t0)


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads (as vLLM does): a port in use or a host this
    machine does not have stops `eyas serve` at once with a clear error, not after minutes of loading and capturing.
    Port 0 takes a free port (the log line names it)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))  # bound, not listening: until uvicorn listens, a client is refused, not left waiting
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _serve_app(app, engine, args, sock: socket.socket | None = None, announce: bool = True) -> None:
    import uvicorn
    sock = sock if sock is not None else listen(args.host, args.port)
    spec = f"speculation {engine.tree.name}" if engine.draft is not None else "no speculation"
    tp = f", tensor parallel {args.tensor_parallel}" if args.tensor_parallel > 1 else ""
    if announce:
        log.info("serving %s (%s%s) on http://%s:%d", args.served_model_name or args.model, spec, tp, args.host,
                 sock.getsockname()[1])
    # SIGTERM (`kill`, `docker stop`, Kubernetes) stops the server as Ctrl-C does. uvicorn shuts the app down on
    # either, then raises the signal again with the handler it found: by default SIGTERM's would kill the process
    # before Python's finalizers ran (an engine process's queues then leave "leaked semaphore" warnings, exit 143).
    prev = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    with sock:
        try:
            app.state.server.wait_for_warmup()
            freeze_heap("server")  # the engine (or the engine process's client) and the app are built: eyas.engine.heap
            uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])
        except (KeyboardInterrupt, _Terminated):  # uvicorn shut the app down, then raised the signal again
            log.info("stopped")
        finally:
            if prev is not None:
                signal.signal(signal.SIGTERM, prev)


class _Terminated(Exception):
    """SIGTERM, raised once uvicorn has shut the app down (`_serve_app`)."""


def _terminated(signum, frame):
    raise _Terminated()


def _tp_serve(rank: int, world_size: int, device, args, options: dict) -> None:
    """One rank of `eyas serve --tensor-parallel N` (started by `eyas.dist.spawn`): every rank loads its shard and
    captures its graphs in the same order; rank 0 runs the HTTP server, whose engine loop drives the lockstep steps
    (`eyas.dist.tp.TPServingEngine`), and the others step until rank 0 stops them."""
    from eyas.dist.tp import TPServingEngine, build_tp_engine
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s")
    tp = build_tp_engine(args.model, resolve_draft_arg(args.model, args.draft), args.speculation, rank, world_size,
                         device, args.dtype, shard_draft=args.tp_draft == "sharded", **_engine_kwargs(args))
    _capture_graphs(tp.engine, args.max_num_seqs, args.capture_extras)
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 shuts down and stops us
        freeze_heap(f"rank {rank}")
        while tp.step() is not None:
            pass
        return
    engine = TPServingEngine(tp)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handler found before
    # it started: with Python's defaults that kills this rank before `close()`, leaving the others in a collective
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        serve_app(engine, args, options)
    finally:
        engine.close()  # the server has stopped (its engine loop too): release the other ranks


def _chat_template(args) -> str | None:
    """--chat-template: a file's text, or the value itself where no such file exists (vLLM reads it so); its Jinja
    is checked now, so a broken one stops the server before it loads anything."""
    value = getattr(args, "chat_template", None)
    if value is None:
        return None
    from pathlib import Path
    try:
        text = Path(value).read_text() if len(value) < 4096 and Path(value).is_file() else value
    except OSError as e:
        raise ValueError(f"--chat-template {value}: {e}") from None
    if text is value and "{" not in value:
        raise ValueError(f"--chat-template {value}: no such file, and no Jinja in it to read as a template")
    from eyas.loader.tokenizer import compile_template
    try:
        compile_template(text)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template: {e}") from None
    return text


def _api_key(args) -> str | None:
    """--api-key, else $EYAS_API_KEY (vLLM reads VLLM_API_KEY so); None or empty: no key is asked for."""
    import os
    return getattr(args, "api_key", None) or os.environ.get("EYAS_API_KEY") or None


def _tool_parser(args) -> str | None:
    """The parser of "auto" tool calls: --tool-call-parser with --enable-auto-tool-choice (vLLM's pair)."""
    return args.tool_call_parser if getattr(args, "enable_auto_tool_choice", False) else None


def _app_options(args) -> dict:
    """`create_app`'s options from the command line, read and checked once, before the model loads: a missing
    template file or a broken template, or --enable-auto-tool-choice without a parser, stops the command there."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({' or '.join(sorted(PARSERS))})")
    interval = getattr(args, "stream_interval", 1)
    if interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {interval}")
    return dict(tool_parser=_tool_parser(args), chat_template=_chat_template(args), api_key=_api_key(args),
                generation_config=getattr(args, "generation_config", "auto"),
                reasoning_parser=getattr(args, "reasoning_parser", None), stream_interval=interval)


def use_engine_process(args) -> bool:
    """--engine-process as given, else on where the engine runs on a GPU (there the step is mostly the host's work,
    which the HTTP side's share of the GIL lengthens: docs/serving.md) and no option it does not combine with is
    set."""
    if getattr(args, "engine_process", None) is not None:
        return args.engine_process
    if args.tensor_parallel > 1 or getattr(args, "disaggregate", None) or getattr(args, "prefill_process", False):
        return False
    from eyas.loader.resolve import resolve_device
    return resolve_device(args.device).type == "cuda"


def run_serve(args) -> int:
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    options = _app_options(args)
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from eyas.serve.api_servers import check_api_server_count, serve_shared
    shared = check_api_server_count(args) > 1  # --api-server-count: turns the engine process on
    if args.tensor_parallel > 1 and getattr(args, "disaggregate", None):
        raise ValueError("--disaggregate does not combine with --tensor-parallel yet")
    if getattr(args, "engine_process", None) is None:
        args.engine_process = use_engine_process(args)
        if args.engine_process:
            log.info("the engine runs in a process of its own (--no-engine-process keeps it in the server's)")
    if args.tensor_parallel > 1 and args.engine_process:
        raise ValueError("--engine-process does not combine with --tensor-parallel yet (rank 0's engine loop drives "
                         "the other ranks)")
    if args.tensor_parallel > 1:
        import torch
        from eyas.dist.launch import run_ranks
        listen(args.host, args.port).close()  # rank 0 binds it again once every rank has loaded: fail early here
        from eyas.spec.draft_quant import asks_quant
        if asks_quant(getattr(args, "draft_quant", None)):
            raise ValueError("--draft-quant does not combine with --tensor-parallel yet")
        if getattr(args, "lora", None):
            raise ValueError("--lora does not combine with --tensor-parallel yet")
        on_gpu = args.device != "cpu" and torch.cuda.is_available()
        try:
            run_ranks(_tp_serve, args.tensor_parallel, args, options, on_gpu=on_gpu, timeout=float("inf"))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: rank 0 shut the server down and stopped the others
            log.info("stopped")
        return 0
    if args.engine_process:
        for flag in ("disaggregate", "prefill_process"):
            if getattr(args, flag, None):
                raise ValueError(f"--engine-process does not combine with --{flag.replace('_', '-')} yet")
    sock = listen(args.host, args.port)
    if shared:
        return serve_shared(args, options, sock)
    try:
        if args.engine_process:
            llm = start_engine_process(args)
        else:
            llm = build_llm(args)
            _capture_graphs(llm.engine, args.max_num_seqs, args.capture_extras)
    except BaseException:
        sock.close()
        raise
    try:
        serve_app(llm, args, options, sock)
    finally:
        if args.engine_process:
            llm.close()
    return 0


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`eyas serve`'s arguments, parsed as the command line parses them."""
    parser = argparse.ArgumentParser(prog="eyas")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    return parser.parse_args(["serve", *argv])


def main(argv: list[str] | None = None) -> int:
    """`python -m eyas.serve.api_server ...`, the same as `eyas serve ...`."""
    args = parse_serve_args(argv if argv is not None else __import__("sys").argv[1:])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
