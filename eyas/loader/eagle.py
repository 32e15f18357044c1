"""EAGLE-1 draft checkpoints: read (config.json + safetensors or pytorch_model.bin) and write (safetensors).

A draft with feature layers (EAGLE-3 style, `eyas.models.eagle`) uses the same layout plus `fuse.weight`
[H, (k+1)H] in the weights and `"eyas_feature_layers": [i_1, ..., i_k]` in config.json. `load_draft` also reads
EAGLE-3 checkpoints (`eyas.loader.eagle3`), which it tells apart by their names."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.config import ModelConfig
from eyas.layers.rotary import RotaryEmbedding
from eyas.loader.hf import load_weights, read_config
from eyas.loader.resolve import _load_state
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM


def load_draft(path: str | Path, target: LlamaForCausalLM, device=None, dtype=None):
    """An EAGLE checkpoint directory (config.json + safetensors or pytorch_model.bin), checked against the target:
    EAGLE-1's layout (eyas's drafts with feature layers too) or EAGLE-3's (`eyas.loader.eagle3`)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"draft {str(path)!r}: not a directory (an EAGLE checkpoint has config.json and weights)")
    raw = read_config(path)
    state = load_weights(path, allow_bin=True)
    from eyas.loader.eagle3 import is_eagle3, load_eagle3
    if is_eagle3(raw, state):  # SafeAILab's or speculators' EAGLE-3 layout
        draft = load_eagle3(path, raw, state, target)
        p = next(target.parameters())
        return draft.to(device=device or p.device, dtype=dtype or p.dtype).eval().requires_grad_(False)
    cfg = ModelConfig.from_hf(raw)
    tcfg = target.config
    if cfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"draft {path}: hidden size {cfg.hidden_size} does not match the target's {tcfg.hidden_size}")
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"draft {path}: vocabulary {cfg.vocab_size} does not match the target's {tcfg.vocab_size}")
    if cfg.feature_layers is not None:
        bad = [i for i in cfg.feature_layers if not 0 <= i < tcfg.num_hidden_layers]
        if bad:
            raise ValueError(f"draft {path}: feature layers {bad} are outside the target's layers "
                             f"0..{tcfg.num_hidden_layers - 1}")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    draft = EagleDraft(cfg)
    draft.rope = RotaryEmbedding.for_config(cfg, tcfg.max_position_embeddings)
    _load_state(draft, state, f"draft {path}")
    p = next(target.parameters())
    draft = draft.to(device=device or p.device, dtype=dtype or p.dtype).eval().requires_grad_(False)
    from eyas.spec.draft_vocab import attach_draft_vocab, load_draft_vocab
    ids = load_draft_vocab(path)
    if ids is not None:  # the draft proposes only these tokens (draft_vocab.safetensors beside its weights)
        attach_draft_vocab(draft, target, ids)
    return draft


def save_draft(draft: EagleDraft, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
               extra_config: dict | None = None) -> Path:
    """Write the EAGLE-1 layout: config.json (a LlamaConfig with the draft's layer count) + model.safetensors. A draft
    with feature layers adds `eyas_feature_layers` to the config and `fuse.weight` to the weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = draft.config.to_hf()
    cfg.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    from eyas.models.fused import hf_state_dict  # HF names even if the draft's projections were fused
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in hf_state_dict(draft).items()
             if not k.startswith("rope.")}
    save_file(state, str(out / "model.safetensors"))
    return out
