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
    files = _safetensors_files(path)
    state: dict[str, torch.Tensor] = {}
    for f in files:
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


# model_type -> architecture
SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "mistral": "MistralForCausalLM"}


def llama_config(path: Path) -> ModelConfig:
    """The ModelConfig of an HF directory, which must hold a Llama model (or a Qwen2 one: Llama's blocks with
    biases on q, k and v; a Qwen3 one: with q and k heads normalised; or a Mistral one), with its
    generation_config.json's settings."""
    raw = read_config(path)
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if raw.get("model_type", "llama") not in SUPPORTED and arch not in SUPPORTED.values():
        raise ValueError(f"{path}: model type {raw.get('model_type')!r} is not supported (eyas loads Llama, Qwen2, "
                         "Qwen3 and Mistral models)")
    cfg = ModelConfig.from_hf(raw)
    read_generation_config(path, cfg)
    return cfg


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(path: Path, cfg: ModelConfig) -> None:
    """A directory's generation_config.json, as vLLM reads it, into `cfg`: its sampling settings (those
    SamplingParams has) as `generation_defaults`, and its end-of-sequence ids among `eos_token_ids`."""
    file = path / "generation_config.json"
    if not file.exists():
        return
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from None
    cfg.generation_defaults = {k: raw[k] for k in SAMPLING_DEFAULTS
                               if isinstance(raw.get(k), (int, float)) and not isinstance(raw[k], bool)}
    eos = raw.get("eos_token_id")
    if eos is not None:
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set([eos] if isinstance(eos, int) else eos))


def load_hf(path: str | Path):
    """-> (ModelConfig, state dict in HF names, Tokenizer or None)."""
    path = Path(path)
    return llama_config(path), load_weights(path), Tokenizer.from_hf_dir(path)


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index lists (ValueError if one is missing), else all of them."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return sorted(path.glob("*.safetensors"))
    files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    for f in files:
        if not f.exists():
            raise ValueError(f"{f}: listed in the safetensors index but missing")
    return files


def load_hf_sharded(path: str | Path, rank: int, world_size: int, device="cpu", dtype=torch.float32, group=None):
    """This rank's tensor-parallel shard of an HF safetensors checkpoint, read slice by slice: each weight is read
    from the files as only the rows or columns this rank keeps (safetensors' `get_slice`), so no rank ever holds the
    whole checkpoint; then `build_target` builds the shard from them. -> (LlamaForCausalLM shard, Tokenizer or None).

    Which slice: a weight whose sharded shape (`meta_target`, sharded on the meta device) differs from the file's in
    dim d keeps the block [rank * ceil(n / W), + its own size) of that dim: q/k/v and gate/up by rows, o/down by
    columns, the embedding and LM head by vocabulary rows (the last rank's block may be short). Anything else is
    read whole."""
    from safetensors import safe_open
    from eyas.loader.resolve import build_target, meta_target
    path = Path(path)
    cfg = llama_config(path)
    files = _safetensors_files(path)
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (slice-wise loading reads safetensors only)")
    shapes = {k: tuple(v.shape) for k, v in meta_target(cfg, rank, world_size).state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name not in shapes:
                    continue
                sl = sf.get_slice(name)
                full, mine = tuple(sl.get_shape()), shapes[name]
                if len(full) != len(mine):
                    raise ValueError(f"{path}: weight {name} has shape {full}, expected {mine}")
                index = []
                for n, m in zip(full, mine):
                    start = 0 if n == m else rank * -(-n // world_size)
                    if start + m > n:
                        raise ValueError(f"{path}: weight {name} has shape {full}, not a whole of {mine} shards")
                    index.append(slice(start, start + m))
                state[name] = sl[tuple(index)]
    target = build_target(cfg, state, str(path), device, dtype, rank, world_size, group)
    return target, Tokenizer.from_hf_dir(path)
