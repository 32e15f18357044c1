"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantised through the `gguf` package -> HF names,
tokenizer from the metadata."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from eyas.config import ModelConfig
from eyas.loader.tokenizer import Tokenizer

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_1"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def _reader(path: Path):
    from gguf import GGUFReader
    try:
        return GGUFReader(str(path))
    except Exception as e:  # bad magic, truncated file, ...
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:
            continue
    return meta


# qwen2: Llama's blocks with biases on q, k and v; qwen3: with q and k heads normalised before RoPE (both without the
# Q/K permutation of llama.cpp's converter)
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def config_from_metadata(meta: dict, path: Path, tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (eyas loads {', '.join(ARCHITECTURES)})")
    a = arch + "."
    try:
        heads = int(meta[a + "attention.head_count"])
        hidden = int(meta[a + "embedding_length"])
        cfg = ModelConfig(
            vocab_size=int(meta.get(a + "vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(meta[a + "feed_forward_length"]),
            num_hidden_layers=int(meta[a + "block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(a + "attention.head_count_kv", heads)),
            head_dim=int(meta.get(a + "attention.key_length", hidden // heads)),
            rms_norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
            max_position_embeddings=int(meta.get(a + "context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                           if k in meta],
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
        )
    except KeyError as e:
        raise ValueError(f"{path}: GGUF metadata lacks {e.args[0]!r}") from None
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: per-frequency RoPE factors (rope_freqs) are not supported yet; "
                         "load the HF checkpoint of this model instead")
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids))
    return cfg


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row permutation of Q/K (interleaved -> HF's half-split RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path):
    """-> (ModelConfig, state dict in HF names (float32), Tokenizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = Path(path)
    reader = _reader(path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = config_from_metadata(meta, path, names)
    permuted = meta.get("general.architecture") == "llama"  # llama.cpp's converter permutes Llama's Q/K rows only
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has type {qtype}, which eyas does not read "
                             f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})")
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
            if not m or m.group(2) not in _LAYER_NAMES:
                continue  # e.g. rope_freqs handled above; unknown extras ignored
            name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(f"{path}: tensor {t.name} could not be decoded ({e})") from None
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(shape)
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        state[name] = w
    return cfg, state, Tokenizer.from_gguf_metadata(meta)


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no tensors are decoded)."""
    return Tokenizer.from_gguf_metadata(read_metadata(_reader(Path(path))))
