"""Model and engine configuration.

`ModelConfig` is the architecture of a Llama-family model, read from an HF `config.json` dict (both the classic
`rope_theta` + `rope_scaling` spelling and transformers 5's `rope_parameters`) or from GGUF metadata. Qwen2 (and
Qwen2.5) checkpoints are Llama models with biases on the q, k and v projections (`qkv_bias`), Qwen3 ones Llama
models whose q and k heads are RMS-normalised before RoPE (`qk_norm`), Mistral ones Llama models. Where a config has
a sliding window (Mistral's `sliding_window`; Qwen2's and Qwen3's with `use_sliding_window`), the context is capped
at the window (`max_position_embeddings`), inside which sliding-window attention is full attention: exact, where
serving longer contexts would not be.
"""
from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Any


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2's attention)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3's attention)
    fc_bias: bool = False  # EAGLE drafts: optional bias of fc
    # EAGLE drafts only: the target layers (0-based) whose rms-normalised outputs the draft reads next to the final
    # hidden state (EAGLE-3 style; `EagleDraft.read_features`). None: EAGLE-1 (the final hidden state only)
    feature_layers: tuple[int, ...] | None = None
    # EAGLE drafts only: the speculation to use when none is asked, per device type ("cuda", "cpu"; "default" for
    # any other): trees fitted to this draft, with batch bounds measured with it (`eyas.spec.dispatch.
    # default_speculation`). None: chain:3
    speculation: dict[str, str] | None = None
    # an HF directory's generation_config.json: the sampling settings its authors recommend (temperature, top_p,
    # top_k, min_p, repetition_penalty; vLLM's `--generation-config auto` makes them a request's defaults). Its
    # end-of-sequence ids join `eos_token_ids` (`eyas.loader.hf.read_generation_config`)
    generation_defaults: dict | None = None
    # EAGLE drafts only: the quantization to apply when none is asked, per device type as `speculation`
    # (`eyas.spec.draft_quant.resolve_draft_quant`; SmolLM2's draft: {"cuda": "fp8-head"}). None: none
    draft_quant: dict[str, str] | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers >= 5
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", params.get("type", "default")) != "default":
                rope_scaling = params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype == "default":
                rope_scaling = None
            elif rtype != "llama3":
                raise ValueError(f"unsupported rope_scaling type {rtype!r} (eyas supports 'llama3')")
            else:
                rope_scaling["rope_type"] = "llama3"
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        arch = (cfg.get("architectures") or [""])[0]
        qwen2 = cfg.get("model_type") == "qwen2" or arch == "Qwen2ForCausalLM"
        qwen3 = cfg.get("model_type") == "qwen3" or arch == "Qwen3ForCausalLM"
        window = cfg.get("sliding_window") if (cfg.get("model_type") == "mistral" or arch == "MistralForCausalLM"
                                               or ((qwen2 or qwen3) and cfg.get("use_sliding_window"))) else None
        max_pos = cfg.get("max_position_embeddings", 2048)
        if window:  # attention within the window is full attention: no longer context than it
            max_pos = min(max_pos, int(window))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qkv_bias=bool(cfg.get("qkv_bias", qwen2)),
            qk_norm=bool(cfg.get("qk_norm", qwen3)),
            fc_bias=bool(cfg.get("bias", False)),
            feature_layers=(tuple(int(i) for i in cfg["eyas_feature_layers"])
                            if cfg.get("eyas_feature_layers") is not None else None),
            speculation=dict(cfg["eyas_speculation"]) if cfg.get("eyas_speculation") else None,
            draft_quant=dict(cfg["eyas_draft_quant"]) if cfg.get("eyas_draft_quant") else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF LlamaConfig dict (classic spelling), as EAGLE checkpoints carry it."""
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bias": self.fc_bias,
        }
        if self.qkv_bias:  # only when set (a draft of a Qwen2 target's shape)
            d["qkv_bias"] = True
        if self.qk_norm:  # only when set (a draft of a Qwen3 target's shape)
            d["qk_norm"] = True
        if self.feature_layers is not None:  # only when set: EAGLE-1 configs stay exactly as they were
            d["eyas_feature_layers"] = list(self.feature_layers)
        if self.speculation:
            d["eyas_speculation"] = dict(self.speculation)
        if self.draft_quant:
            d["eyas_draft_quant"] = dict(self.draft_quant)
        return d

    def asdict(self) -> dict[str, Any]:
        return asdict(self)
