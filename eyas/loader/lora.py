"""LoRA adapters merged into the target at load (`LLM(..., lora=DIR)`, `eyas generate/serve --lora DIR`).

A PEFT adapter directory (`adapter_config.json` with `peft_type` LORA, `adapter_model.safetensors` or
`adapter_model.bin`) of a Llama-family model: each adapted linear's weight becomes W + s * B @ A, with s =
lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`), before the model is built. So the served model is the
fine-tuned one, with every fast path (fused projections, CUDA graphs, one-row kernels) as for any checkpoint, and
speculation stays exact (the draft, trained for the base model, only proposes; it may propose less well). One
adapter per server; vLLM's per-request multi-LoRA is not served.

What PEFT can save beyond plain LoRA of linear layers is refused with a clear error rather than merged wrongly:
DoRA, biases, per-module ranks or alphas, `modules_to_save`, embedding adapters, `fan_in_fan_out`."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

PREFIX = "base_model.model."


def read_adapter(path: str | Path) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(scaling, {base weight name (HF's): (A [r, in], B [out, r])}) of an adapter directory; ValueError for what
    `merge_lora` cannot merge."""
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.exists():
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_config.json (a PEFT adapter directory is expected)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if cfg.get(key, ok) != ok:
            raise ValueError(f"LoRA adapter {str(path)!r}: {key}={cfg.get(key)!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {str(path)!r}: {key} is not supported")
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    if (path / "adapter_model.safetensors").exists():
        from safetensors.torch import load_file
        tensors = load_file(str(path / "adapter_model.safetensors"))
    elif (path / "adapter_model.bin").exists():
        tensors = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_model.safetensors or adapter_model.bin")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key.replace(".default", "")
        for part in ("lora_A", "lora_B"):
            tail = f".{part}.weight"
            if name.endswith(tail):
                base = name[: -len(tail)].removeprefix(PREFIX)
                pairs.setdefault(base + ".weight", {})[part] = t
                break
        else:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is not a LoRA A or B of a linear layer")
    out = {}
    for name, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {str(path)!r}: {name} has only {sorted(ab)}")
        out[name] = (ab["lora_A"], ab["lora_B"])
    if not out:
        raise ValueError(f"LoRA adapter {str(path)!r}: no LoRA weights")
    return scaling, out


def merge_lora(state: dict[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """`state` (a checkpoint's weights in HF names) with the adapter at `path` merged in (in float32, then back to
    each weight's dtype). ValueError for an adapter of another model (a name or a shape it does not have)."""
    scaling, pairs = read_adapter(path)
    for name, (a, b) in pairs.items():
        if name not in state:
            raise ValueError(f"LoRA adapter {str(path)!r}: the model has no weight {name!r} (an adapter of another "
                             "model?)")
        w = state[name]
        if b.shape[0] != w.shape[0] or a.shape[1] != w.shape[1] or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {str(path)!r}: {name} is {tuple(w.shape)}, the adapter's B @ A is "
                             f"{(b.shape[0], a.shape[1])}")
        state[name] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return state
