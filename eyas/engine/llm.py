"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(messages, ...)`."""
from __future__ import annotations

from dataclasses import dataclass, field

from tqdm.auto import tqdm

from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.engine.sequence import SpecStats
from eyas.loader.eagle import load_draft
from eyas.loader.resolve import draft_dir, load_target
from eyas.sampling_params import SamplingParams
from eyas.spec.dispatch import default_speculation
from eyas.spec.draft_quant import apply_draft_quant, asks_quant
from eyas.spec.ngram import NgramProposer, ngram_proposer
from eyas.spec.tree import resolve_tree

NGRAM_SPECULATION = "chain:4"  # n-gram speculation's default: four proposed tokens


def build_engine(target, tokenizer, draft, tree, speculation: str | None = None, **engine_kwargs) -> LLMEngine:
    """The `LLMEngine` of a loaded target and draft (what `LLM` and each tensor-parallel rank build). `tree`: the
    resolved `speculation` (None: the draft's own default for the target's device, else no speculation).
    `engine_kwargs` go to `EngineConfig`; cuda_graphs="auto": graphs wherever they can run (on a GPU). ValueError:
    a speculation without a draft."""
    device = next(target.parameters()).device
    if tree is not None and draft is None:
        raise ValueError(f"speculation {speculation!r} needs a draft model (draft=...)")
    if isinstance(draft, NgramProposer) and tree is None:
        tree = resolve_tree(NGRAM_SPECULATION)
    if draft is not None and tree is None:
        tree = resolve_tree(default_speculation(draft, device))
    if engine_kwargs.get("cuda_graphs") == "auto":
        engine_kwargs["cuda_graphs"] = device.type == "cuda"
    return LLMEngine(target, tokenizer, draft, tree, EngineConfig(**engine_kwargs))


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the new tokens only
    text: str
    finish_reason: str | None
    stats: SpecStats = field(default_factory=SpecStats)
    ttft: float | None = None  # seconds from submission to the first token
    latency: float | None = None  # seconds from submission to the last token
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (eyas.cache.prefix_cache)
    logprobs: list | None = None  # `SamplingParams.logprobs`: each token's `eyas.layers.logprobs.TokenLogprobs`
    # `SamplingParams.prompt_logprobs`: those of the prompt's tokens, None first (the first token has none)
    prompt_logprobs: list | None = None


class LLM:
    """model: "smollm2" | HF directory | .gguf file. draft: EAGLE checkpoint directory, "default" (the draft shipped
    for smollm2), "ngram" / "ngram:N_MIN:N_MAX" (prompt lookup, no draft model: `eyas.spec.ngram`; speculation a
    chain, chain:4 by default) or None. speculation: None | "chain:K" | "tree:NAME" | a JSON file of paths |
    "dispatch:B1=SPEC,..." (a tree per batch size). draft_quant: "int4" | "int4-ffn" | "int4-head" | "fp8" |
    "fp8-head" | "none" | None (`eyas.spec.draft_quant`: the draft's FFN and/or its own LM head copy in INT4, or all
    its weights in FP8, or only its head's copy; None: the draft's own choice for the device, fp8-head for SmolLM2's
    on a GPU). Engine settings (`EngineConfig`) go as keywords; `cuda_graphs="auto"` turns CUDA graphs on where the
    model runs on a GPU."""

    def __init__(self, model: str = "smollm2", device: str = "auto", dtype: str = "auto",
                 draft: str | None = None, speculation: str | None = None, draft_quant: str | None = None,
                 disaggregate: str | None = None, prefill_process: bool = False, lora: str | None = None,
                 **engine_kwargs):
        """`disaggregate`: "PREFILL_DEVICE,DECODE_DEVICE" (e.g. "cuda:0,cuda:1"): prompts are prefilled by an engine
        on the first device, then decoded by one on the second (`eyas.engine.disagg`; the model is loaded on each,
        and `device` is not used). `prefill_process`: the prefill engine runs in a child process
        (`eyas.engine.prefill_process`), not on a thread of this one. `lora`: a PEFT LoRA adapter directory merged
        into the target's weights at load (`eyas.loader.lora`)."""
        if lora is not None and prefill_process:
            raise ValueError("lora with prefill_process is not supported (the child process loads the base model)")
        self.lora = lora
        if asks_quant(draft_quant) and draft is None:
            raise ValueError(f"draft_quant={draft_quant!r} needs a draft (draft=...)")
        tree = resolve_tree(speculation)  # a bad name fails before anything loads
        if prefill_process and disaggregate is None:
            raise ValueError("prefill_process=True needs disaggregate='PREFILL_DEVICE,DECODE_DEVICE'")
        if disaggregate is not None:
            from eyas.engine.disagg import DisaggregatedEngine, split_devices
            pre_dev, dec_dev = split_devices(disaggregate)
            self._load(model, str(dec_dev), dtype, draft, draft_quant)
            decode = build_engine(self.target, self.tokenizer, self.draft, tree, speculation, **engine_kwargs)
            if prefill_process:
                from eyas.engine.prefill_process import RemotePrefillEngine
                prefill = RemotePrefillEngine(decode, model, str(pre_dev), dtype, draft, speculation, draft_quant,
                                              **engine_kwargs)
            else:
                prefill = build_engine(*self._loaded(model, str(pre_dev), dtype, draft, draft_quant), tree,
                                       speculation, **engine_kwargs, role="prefill")
            self.engine = DisaggregatedEngine(prefill, decode, threaded=True)
            return
        self._load(model, device, dtype, draft, draft_quant)
        self.engine = build_engine(self.target, self.tokenizer, self.draft, tree, speculation, **engine_kwargs)

    def _load(self, model, device, dtype, draft, draft_quant) -> None:
        self.target, self.tokenizer, self.draft = self._loaded(model, device, dtype, draft, draft_quant)

    def _loaded(self, model, device, dtype, draft, draft_quant):
        """(target, tokenizer, draft) loaded on `device` (the target with `self.lora` merged)."""
        target, tokenizer = load_target(model, device, dtype, self.lora)
        proposer = ngram_proposer(draft)
        if proposer is not None:  # n-gram speculation: no draft model
            if asks_quant(draft_quant):
                raise ValueError(f"draft_quant={draft_quant!r} needs a draft model, not {draft!r}")
            return target, tokenizer, proposer
        d = load_draft(draft_dir(model, draft), target) if draft is not None else None
        if d is not None:  # INT4 / FP8 draft weights (eyas.spec.draft_quant), as asked or the draft's own
            apply_draft_quant(d, target, draft_quant)
        return target, tokenizer, d

    def default_sampling_params(self) -> SamplingParams:
        """The sampling settings `generate` uses when given none: the model's generation_config.json's (temperature,
        top_p, top_k, min_p, repetition_penalty; vLLM's `get_default_sampling_params`) over SamplingParams'
        defaults (greedy)."""
        return SamplingParams(**(self.target.config.generation_defaults or {}))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or self.default_sampling_params()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        engine = self.engine
        seqs = []
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm)
        try:
            for p, sp in zip(prompts, plist):
                seqs.append(engine.add_request(p, sp))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        bar.update(1)
        finally:
            bar.close()
            for s in seqs:  # an exception mid-way (a bad request among them, a failed step) leaves none queued
                if not s.finished:
                    engine.abort(s.request_id)
        return [CompletionOutput(s.prompt_ids, s.output_ids, s.text, s.finish_reason, s.stats,
                                 (s.first_token_time - s.arrival) if s.first_token_time else None,
                                 (s.finish_time - s.arrival) if s.finish_time else None,
                                 min(s.prefix_hit, s.num_prompt),
                                 list(s.logprobs) if s.params.logprobs is not None else None,
                                 [None] + list(s.prompt_logprobs) if s.params.prompt_logprobs is not None else None)
                for s in seqs]

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool = False,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None):
        """One conversation (a list of {"role", "content"}) or a list of conversations. `continue_final_message`:
        the model goes on writing the last message (an assistant reply begun by the caller) instead of answering
        it; `tools`: OpenAI's tool definitions, for the chat template; `chat_template`: a Jinja template in place of
        the model's; `chat_template_kwargs`: more variables for it (`Tokenizer.apply_chat_template`)."""
        single = bool(messages) and isinstance(messages[0], dict)
        prompts = [self.chat_prompt_ids(c, continue_final_message, tools, chat_template, chat_template_kwargs)
                   for c in ([messages] if single else messages)]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, conversation: list[dict], continue_final_message: bool = False,
                        tools: list[dict] | None = None, chat_template: str | None = None,
                        chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids `chat` sends for one conversation (its arguments as there)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=not continue_final_message,
            continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
            **(chat_template_kwargs or {})), add_bos=False)  # the template writes any BOS itself (as vLLM and HF)
