"""HF checkpoint directories: config.json plus one or several safetensors files (with an index)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.config import ModelConfig
from eyas.loader.tokenizer import Tokenizer


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise ValueError(f"{path}: no config.json (an HF model directory needs one)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from None


def load_weights(path: Path, allow_bin: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: sharded (index), single or several safetensors, or pytorch_model.bin."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / f for f in files]
    else:
        files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise ValueError(f"{f}: listed in the safetensors index but missing")
        try:
            state.update(load_file(str(f)))
        except Exception as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    if not files and allow_bin:
        for f in sorted(path.glob("pytorch_model*.bin")):
            try:
                state.update(torch.load(f, map_location="cpu", weights_only=True))
            except Exception as e:
                raise ValueError(f"{f}: not a readable PyTorch checkpoint ({e})") from None
    if not state:
        raise ValueError(f"{path}: no weights found (*.safetensors{' or pytorch_model.bin' if allow_bin else ''})")
    return state


def load_hf(path: str | Path):
    """-> (ModelConfig, state dict in HF names, Tokenizer or None)."""
    path = Path(path)
    raw = read_config(path)
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if raw.get("model_type", "llama") != "llama" and arch != "LlamaForCausalLM":
        raise ValueError(f"{path}: model type {raw.get('model_type')!r} is not supported (eyas loads Llama models)")
    cfg = ModelConfig.from_hf(raw)
    return cfg, load_weights(path), Tokenizer.from_hf_dir(path)
