"""EAGLE-3 draft checkpoints (`eyas.models.eagle3`): SafeAILab/EAGLE's layout (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`; config.json a LlamaConfig with `draft_vocab_size`) and vllm-project/speculators' (the
same weights under `layers.0.*`, the Llama config nested in `transformer_layer_config`), with or without a `model.`
prefix, in safetensors or pytorch_model.bin.

The target's feature layers come from the config: a top-level `eagle_aux_hidden_state_layer_ids` (vLLM's
convention: the input of layer i), else `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's: the output of
layer i), else (2, L//2, L-3). `t2d` (a training-time mask) is not read. What these checkpoints may hold that the
draft here cannot compute is refused with a clear error: a draft wider than the target (`target_hidden_size`), an
embedding of its own that differs from the target's, `use_aux_hidden_state: false`, an input norm before fc.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eyas.config import ModelConfig
from eyas.layers.rotary import RotaryEmbedding
from eyas.loader.resolve import _load_state
from eyas.models.eagle3 import Eagle3Draft, eagle3_feature_layers


def flat_config(raw: dict) -> dict:
    """A speculators config's Llama settings lifted to the top level (its own keys kept); others unchanged."""
    if raw.get("speculators_model_type") is None:
        return raw
    if raw["speculators_model_type"] != "eagle3":
        raise ValueError(f"speculators model type {raw['speculators_model_type']!r} is not served (eagle3 is)")
    return {**raw.get("transformer_layer_config", {}), **{k: v for k, v in raw.items()
                                                          if k != "transformer_layer_config"}}


def is_eagle3(raw: dict, names) -> bool:
    """Whether a draft checkpoint (its config.json, its weight names) is an EAGLE-3 one."""
    arch = " ".join(raw.get("architectures") or [])
    return ("Eagle3" in arch or raw.get("speculators_model_type") == "eagle3"
            or any(n.removeprefix("model.").startswith("midlayer.") or n.endswith("hidden_norm.weight")
                   for n in names))


def _rename(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("midlayer."):
        name = "layers.0." + name.removeprefix("midlayer.")
    return "fuse." + name.removeprefix("fc.") if name.startswith("fc.") else name


def load_eagle3(path: Path, raw: dict, state: dict[str, torch.Tensor], target) -> Eagle3Draft:
    """The draft of an EAGLE-3 checkpoint (`raw`: its config.json, `state`: its weights), checked against `target`,
    in float32 on the CPU (the caller moves it), its head attached (`Eagle3Draft.attach_head`)."""
    raw = flat_config(raw)
    tcfg = target.config
    cfg = ModelConfig.from_hf(raw)
    where = f"EAGLE-3 draft {path}"
    if cfg.hidden_size != tcfg.hidden_size or raw.get("target_hidden_size", tcfg.hidden_size) != tcfg.hidden_size:
        raise ValueError(f"{where}: hidden size {cfg.hidden_size} (target_hidden_size "
                         f"{raw.get('target_hidden_size')}) against the target's {tcfg.hidden_size}: drafts of "
                         "another width are not served")
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{where}: vocabulary {cfg.vocab_size} does not match the target's {tcfg.vocab_size}")
    eagle = raw.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True):
        raise ValueError(f"{where}: use_aux_hidden_state false (a draft of the last hidden state) is not served")
    if raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        layers = eagle3_feature_layers(tcfg.num_hidden_layers, raw["eagle_aux_hidden_state_layer_ids"])
    elif eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
        layers = eagle3_feature_layers(tcfg.num_hidden_layers, eagle["eagle_aux_hidden_state_layer_ids"],
                                       output_ids=True)
    else:
        layers = eagle3_feature_layers(tcfg.num_hidden_layers)

    state = {_rename(k): v for k, v in state.items() if not k.endswith("t2d")}
    emb = state.pop("embed_tokens.weight", None)
    own = target.model.embed_tokens  # under tensor parallelism, this rank's rows [start, end) of it
    start = getattr(own, "start", 0)
    if emb is not None and not torch.equal(emb[start: start + own.weight.shape[0]].float(),
                                           own.weight.detach().float().cpu()):
        raise ValueError(f"{where}: its embed_tokens differ from the target's (a draft embedding of its own is not "
                         "served)")
    if "input_norm.weight" in state:
        raise ValueError(f"{where}: an input norm before fc (speculators' norm_before_fc) is not served")
    if "lm_head.weight" not in state or "fuse.weight" not in state:
        raise ValueError(f"{where}: fc.weight and lm_head.weight are needed")
    vd = state["lm_head.weight"].shape[0]
    if raw.get("draft_vocab_size", vd) != vd:
        raise ValueError(f"{where}: lm_head has {vd} rows but draft_vocab_size is {raw['draft_vocab_size']}")
    if "d2t" not in state:
        if vd != tcfg.vocab_size:
            raise ValueError(f"{where}: a draft vocabulary of {vd} tokens needs its d2t map")
        state["d2t"] = torch.zeros(vd, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    fc = state["fuse.weight"]
    if tuple(fc.shape) != (cfg.hidden_size, len(layers) * cfg.hidden_size):
        raise ValueError(f"{where}: fc.weight is {list(fc.shape)}, not [{cfg.hidden_size}, "
                         f"{len(layers) * cfg.hidden_size}] for {len(layers)} feature layers")
    draft = Eagle3Draft(cfg, layers, vd, norm_before_residual=bool(raw.get("norm_before_residual", False)),
                        fc_bias="fuse.bias" in state)
    draft.rope = RotaryEmbedding.for_config(cfg, tcfg.max_position_embeddings)  # the draft's theta, the target's reach
    extra = sorted(set(state) - set(draft.state_dict()))
    if extra:
        raise ValueError(f"{where}: weights this draft has no place for: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    _load_state(draft, state, where)
    draft.attach_head()
    ids = draft.vocab_ids
    if int(ids.min()) < 0 or int(ids.max()) >= tcfg.vocab_size or ids.unique().numel() != vd:
        raise ValueError(f"{where}: d2t maps its draft tokens outside the target's vocabulary, or two onto one")
    return draft
