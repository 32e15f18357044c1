"""Request and response models of the OpenAI-compatible API, and OpenAI's error JSON.

Requests are validated in two layers:
* the schema (pydantic): a field of the wrong type, a missing field, a body that is not a JSON object -> 422;
* the values (here, `SamplingParams` and the engine): `max_tokens` < 1 or beyond the context, `temperature` < 0,
  a prompt longer than the context, an unknown model, ... -> 400 (404 for an unknown model, as OpenAI does).
Unknown extra fields are ignored, as vLLM does, so that clients sending newer OpenAI fields keep working.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# ---- errors -------------------------------------------------------------------------------------------------------


class APIError(Exception):
    """Raised by handlers; turned into `{"error": {...}}` with its HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def api_error_response(e: APIError) -> JSONResponse:
    return error_response(e.message, e.status, e.type, e.param, e.code, e.headers)


# ---- requests -----------------------------------------------------------------------------------------------------


class _Request(BaseModel):
    # strict numbers: `"max_tokens": true` or `"n": 2.5` is a schema error, not 1 or 2; an int is a valid float.
    # No NaN or infinity: they would reach the sampler.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _SamplingFields(_Request):
    """Fields shared by both endpoints. Types are checked here; values by SamplingParams and the engine."""
    model: str
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # None: 1.0, OpenAI's default
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # not in OpenAI's API; vLLM's extension
    min_p: StrictFloat | None = None  # vLLM's extension
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension
    user: str | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None  # vLLM's extension
    logit_bias: dict[str, StrictFloat] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    stop_token_ids: list[StrictInt] | None = None  # vLLM's extension
    include_stop_str_in_output: StrictBool = False  # vLLM's extension
    skip_special_tokens: StrictBool = True  # vLLM's extension
    truncate_prompt_tokens: StrictInt | None = None  # vLLM's extension: the prompt's last k tokens only
    min_tokens: StrictInt | None = None  # vLLM's extension
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's extension: the output's tokens are drawn from these
    prompt_logprobs: StrictInt | None = None  # vLLM's extension: each prompt token's, and the k likeliest in its place
    bad_words: list[StrictStr] | None = None  # vLLM's extension: words and phrases the output never contains
    priority: StrictInt = 0  # vLLM's extension: lower is served first (with --scheduling-policy priority)
    # vLLM's extension: log-probabilities name tokens "token_id:<id>" instead of by their text
    return_tokens_as_token_ids: StrictBool = False
    # guided decoding, vLLM's extensions (chat also takes OpenAI's response_format): at most one of them
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls (OpenAI's {"id", "type", "function"})
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    # an assistant's thinking (a reasoning model's earlier turn): vLLM's field and its older name, which templates
    # (Qwen3's) read as `reasoning_content`
    reasoning: str | None = None
    reasoning_content: str | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it (eyas.serve.tools.template_tool_calls for the calls)."""
        from eyas.serve.tools import template_tool_calls
        m = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls is not None:
            m["tool_calls"] = template_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            m["reasoning_content"] = thinking
        return m

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None  # the newer name of max_tokens
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: StrictBool = True
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", ...}}
    response_format: dict | None = None
    add_generation_prompt: StrictBool = True  # vLLM's extensions: the template's opening of the reply, or
    continue_final_message: StrictBool = False  # the last message left open for the model to go on with
    chat_template: str | None = None  # vLLM's: a Jinja template in place of the server's
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the template
    add_special_tokens: StrictBool = False  # vLLM's: the tokenizer's BOS before the template's text too
    include_reasoning: StrictBool = True  # vLLM's: with a reasoning parser, false drops the thinking from the reply


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages (through the chat template), as the engine would read it."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # messages only: the chat template's tools
    add_generation_prompt: StrictBool = True  # messages only
    continue_final_message: StrictBool = False  # messages only (as /v1/chat/completions)
    chat_template: str | None = None  # messages only (as /v1/chat/completions)
    chat_template_kwargs: dict | None = None
    add_special_tokens: StrictBool | None = None  # vLLM's: the tokenizer's BOS (default: prompts yes, messages no)
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Request):
    """vLLM's /detokenize: token ids back to text."""
    model: str | None = None
    tokens: list[StrictInt]


# ---- responses ----------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held (eyas.cache.prefix_cache)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)).model_dump()


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "eyas"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
