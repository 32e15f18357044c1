"""EAGLE-1 draft training by online distillation: `eyas train-draft`.

The target is frozen and runs inside the loop. For every batch it computes the final hidden states h (after the
final norm) and, at the trained positions, its logits; nothing is precomputed to disk. Draft position t reads
(embed(x_{t+1}), h_t) and must predict h_{t+1} (SmoothL1) and the target's distribution at t+1, i.e. for token
x_{t+2} (soft cross-entropy through the shared, frozen LM head). The loss mask is the assistant mask of x_{t+2}.

`--unroll K` trains on the draft's own rollouts as well (EAGLE-3's "training-time test"): chain step d >= 2 reads
the draft's predicted feature from step d-1 instead of the target's, with the same targets; the steps' losses are
weighted decay^(d-1). See `unrolled_loss`.

Training: AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA (fp32 master weights),
optional uniform or Gaussian noise on the target features (EAGLE: uniform, width 0.2), a fixed seed. Several drafts
(e.g. `--layers 1 2 3`) can be trained side by side on the same batches: the target runs once per batch for all.

Checkpoints hold drafts, optimisers, schedulers, the noise RNG and the data position (epoch, batch): the batch plan
is a pure function of (seed, epoch), so a resumed run repeats the uninterrupted run's loss curve.

Evaluation on held-out conversations: the distillation loss, top-1 accuracy per depth (depth d: the draft is unrolled
on its own predicted features for d-1 steps, with the data's tokens, exactly as a chain step sees it when the
earlier tokens were accepted) and the TPC of `chain:3` through the engine on the held-out first turns.

`--feature-layers I ...` (EAGLE-3-style features): the drafts also read the target's rms-normalised residual stream
after layers I... (`LlamaForCausalLM.forward(feature_layers=...)`), mapped to H by the draft's `fuse`
(`EagleDraft.read_features`, trained with the rest). `fuse` starts at the identity on the final hidden state, so a
run with `--init` of an EAGLE-1 checkpoint starts from exactly that draft. The noise applies to the raw features;
the L1 target stays the final hidden state h_{t+1}.

`--init CKPT` starts every draft from an EAGLE checkpoint; a draft with more layers than CKPT grows from it (the added
layers start as the identity, `init_from_checkpoint`), so `--layers 1 2 3 --init <1-layer draft>` trains three drafts
that all begin exactly as the 1-layer one.

Output: the EAGLE-1 checkpoint layout (config.json + model.safetensors, bf16 by default; with feature layers also
`fuse.weight` and `eyas_feature_layers`) and `training.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from eyas.models.eagle import EagleDraft
from eyas.train.data import (Example, collate, first_answer_tokens, length_batches, load_examples, plan_epoch,
                             split_heldout)
from eyas.train.loss import distill_loss


@dataclass
class TrainConfig:
    data: list[str] = field(default_factory=list)
    out: str = "runs/draft"
    target: str = "smollm2"
    layers: list[int] = field(default_factory=lambda: [1])
    device: str = "auto"
    target_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    amp: bool = True  # bf16 autocast for the draft on CUDA
    max_len: int = 2048
    limit: int | None = None  # read at most this many conversations
    heldout: int = 64  # conversations kept out of training, for evaluation
    batch_tokens: int = 16384  # padded tokens per batch (B * T)
    max_batch: int = 64
    pad_multiple: int = 0  # round batch lengths up to this (0: 64 on CUDA, 1 on the CPU)
    fast_target: bool | None = None  # the target on the fused inference kernels (None: on CUDA)
    epochs: int = 1
    max_steps: int | None = None  # cap on the schedule's length
    stop_after: int | None = None  # stop (and checkpoint) at this step; the schedule is unchanged
    time_budget: float | None = None  # seconds of training after which to stop (and checkpoint)
    lr: float = 5e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int | None = None  # None: 3% of the schedule
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.5
    w_ce: float = 0.1
    w_l1: float = 1.0
    ce_temperature: float = 1.0  # < 1: the CE term's soft labels sharpened towards the target's argmax (loss.py)
    w_hard: float = 0.0  # > 0: a CE term against the target's argmax beside the soft one (loss.py)
    feature_layers: list[int] | None = None  # target layers the drafts also read (EAGLE-3 style); None: EAGLE-1
    answer_tokens: int | None = None  # train on the first N tokens of each assistant turn only (None: all)
    unroll: int = 1  # train on the draft's own rollouts, chain steps 1..unroll (EAGLE-3's training-time test)
    unroll_decay: float = 0.8  # weight of chain step d's loss: decay^(d-1) (EAGLE-3: 0.8)
    noise: str = "uniform"  # none | uniform | gaussian
    noise_std: float = 0.2  # uniform: U(-std/2, std/2) as EAGLE; gaussian: N(0, std)
    seed: int = 0
    init: str | None = None  # start every draft from this EAGLE checkpoint (deeper and wider drafts grow from it)
    draft_intermediate: int | None = None  # the drafts' MLP width (None: the target's intermediate size)
    eval_every: int = 0  # steps; 0: only at the end
    eval_depth: int = 3
    eval_batch_tokens: int = 8192
    eval_conversations: int | None = None  # None: all held-out conversations for the loss / accuracy
    tpc_prompts: int = 32  # held-out first turns for the chain:3 TPC (0: skip)
    tpc_max_tokens: int = 64
    save_every: int = 0  # steps; 0: only at the end
    keep_checkpoints: int = 2
    resume: str | None = None  # a checkpoint file, or "auto" (latest under out/checkpoints)
    save_dtype: str = "bfloat16"
    progress: bool = True


# ---- helpers ---------------------------------------------------------------------------------------------------

def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _autocast(device: torch.device, enabled: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled and device.type == "cuda")


def attention_backends(device: torch.device):
    """On CUDA, SDPA without the cuDNN backend: cuDNN builds an execution plan per new shape, and training batches
    come in many shapes. Flash attention (GQA-aware in bf16) takes the causal passes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def make_draft(target, layers: int, feature_layers=None, intermediate: int | None = None) -> EagleDraft:
    """A randomly initialised draft for `target`; with `feature_layers`, its `fuse` starts at the identity on the
    final hidden state (fc and the layers draw the same random init as without). `intermediate`: the MLP width of its
    layers (default: the target's)."""
    from eyas.layers.rotary import RotaryEmbedding
    tcfg = target.config
    fl = tuple(int(i) for i in feature_layers) if feature_layers is not None else None
    if fl is not None:
        bad = [i for i in fl if not 0 <= i < tcfg.num_hidden_layers]
        if bad:
            raise ValueError(f"feature layers {bad} are outside the target's layers 0..{tcfg.num_hidden_layers - 1}")
    if intermediate is not None and intermediate < 1:
        raise ValueError(f"--draft-intermediate must be positive, got {intermediate}")
    cfg = dataclasses.replace(tcfg, num_hidden_layers=layers, fc_bias=False, feature_layers=fl,
                              intermediate_size=intermediate or tcfg.intermediate_size)
    draft = EagleDraft(cfg)
    draft.rope = RotaryEmbedding.for_config(cfg, tcfg.max_position_embeddings)  # as load_draft builds it
    if fl is not None:
        draft.init_fuse_identity()
    return draft


def init_from_checkpoint(draft: EagleDraft, path: Path) -> None:
    """Load an EAGLE checkpoint into `draft` (`--init`), so that training starts from exactly the draft it holds.

    * An EAGLE-1 checkpoint initialises a feature-layer draft (`fuse` stays at the identity); a feature-layer
      checkpoint a draft whose feature layers include its own (in any order): `fuse`'s columns for the checkpoint's
      layers and the final hidden state are the checkpoint's, those of the added layers start at zero, so the draft
      computes exactly what the checkpoint's does and learns to read the new layers from the first step.
    * Growing: a checkpoint with fewer decoder layers fills the first ones; each added layer's residual branches start
      at zero (o_proj and down_proj zeroed, the rest keeps its random init), so it passes its input through and the
      deeper draft computes exactly what the checkpoint's draft does. Gradients reach those projections at once and
      the rest of the layer from the next step on (as a zero-initialised LoRA B).
    * Widening: a checkpoint with a narrower MLP fills the first units of each of its layers; the added units' down
      projection columns start at zero (their gate and up rows keep the random init), so again the draft computes
      exactly what the checkpoint's does."""
    from eyas.config import ModelConfig
    from eyas.loader.eagle3 import is_eagle3
    from eyas.loader.hf import load_weights, read_config
    raw, weights = read_config(path), load_weights(path, allow_bin=True)
    if is_eagle3(raw, weights):
        raise ValueError(f"--init {path}: an EAGLE-3 checkpoint (its draft is served, not trained, by eyas)")
    icfg = ModelConfig.from_hf(raw)
    L, fl = len(draft.layers), draft.feature_layers
    if icfg.num_hidden_layers > L:
        raise ValueError(f"--init {path} has {icfg.num_hidden_layers} layers, more than the {L} of this draft")
    fl0 = None if icfg.feature_layers is None else tuple(icfg.feature_layers)
    if fl0 is not None and (fl is None or not set(fl0) <= set(fl)):
        raise ValueError(f"--init {path} reads feature layers {list(fl0)}, --feature-layers says "
                         f"{None if fl is None else list(fl)} (it may add layers, not drop them)")
    st = {k.removeprefix("model."): v.float() for k, v in weights.items()}
    if fl0 is not None and fl0 != fl:  # more feature layers (or another order): the checkpoint's columns moved
        H = draft.config.hidden_size
        w0, w = st["fuse.weight"], torch.zeros_like(draft.fuse.weight, dtype=torch.float32)
        for j, layer in enumerate(fl0):
            i = fl.index(layer)
            w[:, i * H:(i + 1) * H] = w0[:, j * H:(j + 1) * H]
        w[:, -H:] = w0[:, -H:]  # the final hidden state, last in both
        st["fuse.weight"] = w
    I, I0 = draft.config.intermediate_size, icfg.intermediate_size
    if I0 > I:
        raise ValueError(f"--init {path} has MLPs {I0} wide, wider than the {I} of this draft")
    if I0 < I:  # widen: the checkpoint's units first, the new ones silent (down columns zero)
        own = draft.state_dict()
        for k in [k for k in st if ".mlp." in k and k in own and st[k].shape != own[k].shape]:
            w, full = st[k], own[k].detach().clone().float()
            if k.endswith("down_proj.weight"):
                full[:, :I0] = w
                full[:, I0:] = 0
            else:  # gate and up: their weights' rows, and their biases where the model has them
                full[:I0] = w
            st[k] = full
    _, unexpected = draft.load_state_dict(st, strict=False)
    unexpected = [k for k in unexpected if k not in ("embed_tokens.weight", "lm_head.weight")]  # shared with the target
    if unexpected:
        raise ValueError(f"--init {path}: weights this draft does not have: {unexpected[:4]}")
    with torch.no_grad():
        for layer in draft.layers[icfg.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            for b in (layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias):
                if b is not None:
                    b.zero_()


def _rng_state(noise_gen: torch.Generator) -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
          "noise": noise_gen.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict, noise_gen: torch.Generator) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    noise_gen.set_state(st["noise"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def draft_inputs(target, ids: torch.Tensor, amask: torch.Tensor, feature_layers=None):
    """One target pass -> (token embeds [B,T-1,H], features h_t [B,T-1,H], positions [B,T-1], target features
    h_{t+1} [B,T-1,H], loss mask [B,T-1] (assistant mask of x_{t+2})).

    With `feature_layers`, the features at t are the target's raw multi-layer features [B,T-1,(k+1)H] (the draft
    reads them through `read_features`); the target h_{t+1} stays the final hidden state."""
    B, T = ids.shape
    pos = torch.arange(T, device=ids.device)[None, :].expand(B, T)
    with torch.no_grad():
        if feature_layers is None:
            h = f = target(ids, pos)
        else:
            fl = feature_layers if isinstance(feature_layers, tuple) else tuple(feature_layers)  # RawTaps kept
            h, f = target(ids, pos, feature_layers=fl)
        emb = target.embed(ids[:, 1:])
    lmask = torch.zeros(B, T - 1, dtype=torch.bool, device=ids.device)
    lmask[:, : T - 2] = amask[:, 2:]
    return emb, f[:, :-1], pos[:, :-1], h[:, 1:], lmask


def shared_feature_layers(drafts: list[EagleDraft]) -> tuple[int, ...] | None:
    """The feature layers of drafts that share one target pass: they must all read the same ones."""
    fls = {d.feature_layers for d in drafts}
    if len(fls) > 1:
        raise ValueError(f"drafts trained or evaluated together must read the same feature layers, got {fls}")
    return next(iter(fls)) if fls else None


def _noise(x: torch.Tensor, kind: str, std: float, gen: torch.Generator) -> torch.Tensor:
    if kind == "none" or std <= 0:
        return x
    if kind == "uniform":
        n = (torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) - 0.5) * std
    elif kind == "gaussian":
        n = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32) * std
    else:
        raise ValueError(f"noise must be none, uniform or gaussian, got {kind!r}")
    return (x.float() + n).to(x.dtype)


# ---- unrolled evaluation -----------------------------------------------------------------------------------------

def stream_mask(S: int, T: int, device) -> torch.Tensor:
    """Attention mask [T, S*T] of stream S's queries over the keys of streams 1..S (the draft over T positions).

    Stream 1 reads the target's features (causal). Stream s >= 2 at index p is the draft's (s-1)-th step of a chain
    rooted at t = p - s + 1: its input feature is stream s-1's output at p-1, and it sees stream 1 at indices <= t
    (the draft KV cache of committed history) and stream r (2 <= r <= s) at index p - (s - r) only (its own chain).
    A stream never sees later ones, so stacking these rows for S = 1..depth gives the whole masked pass's mask.
    """
    p = torch.arange(T, device=device)
    M = torch.zeros(T, S * T, dtype=torch.bool, device=device)
    for r in range(1, S + 1):
        if r == 1:
            blk = p[None, :] <= (p[:, None] - (S - 1))
        else:
            blk = p[None, :] == (p[:, None] - (S - r))
        M[:, (r - 1) * T: r * T] = blk
    return M


def _layer_stream(layer, x, positions, rope, kv: list, mask):
    """One decoder layer for the newest stream: its queries attend to the keys of all streams so far (`kv` holds the
    earlier streams' K/V of this layer, and gets this stream's appended), under `mask` [T, S*T]. A stream's values
    never depend on later streams, so the earlier streams' K/V are exactly those of the whole masked pass."""
    return _stream(layer, layer.input_layernorm(x), x, positions, rope, kv, mask)


def _stream(layer, h, residual, positions, rope, kv: list, mask):
    """`_layer_stream` from the layer's attention input `h` (its input norm applied; an EAGLE-3 checkpoint's first
    layer: `Eagle3Layer.attention_input`) and the residual it adds to."""
    a = layer.self_attn
    B, Q, _ = h.shape
    q, k, v = a.project(h, positions, rope)
    G = a.n_heads // a.n_kv
    # GQA by repetition: with an explicit mask, the memory-efficient SDPA kernel (no enable_gqa) takes the pass
    kv.append((k.repeat_interleave(G, dim=2).transpose(1, 2), v.repeat_interleave(G, dim=2).transpose(1, 2)))
    K = torch.cat([kk for kk, _ in kv], 2)
    V = torch.cat([vv for _, vv in kv], 2)
    if len(kv) == 1:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, is_causal=True, scale=a.scale)
    else:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, attn_mask=mask, scale=a.scale)
    x = residual + a.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def unrolled_streams(draft: EagleDraft, emb: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                     depth: int) -> list[torch.Tensor]:
    """Outputs [B, T, H] of streams 1..depth (stream d = the draft's d-th chain step, see `stream_mask`).

    `feats` are the target's features as `draft_inputs` returns them (multi-layer for a draft with feature layers):
    stream 1 reads `draft.read_features(feats)` (the identity for an EAGLE-1 draft). Stream by stream, each layer
    keeping the K/V of the earlier streams: depth d costs d stream passes. Differentiable (training-time unrolling
    backpropagates through the draft's own features)."""
    feat = draft.read_features(feats).to(emb.dtype)
    B, T, H = feat.shape
    kv: list[list] = [[] for _ in draft.layers]
    outs: list[torch.Tensor] = []
    from eyas.models.eagle3 import Eagle3Draft
    eagle3 = isinstance(draft, Eagle3Draft)  # its first layer reads the embedding and the feature apart
    for S in range(1, depth + 1):
        mask = stream_mask(S, T, emb.device)
        if eagle3:
            x = _stream(draft.layers[0], *draft.layers[0].attention_input(emb, feat), positions, draft.rope, kv[0],
                        mask)
        else:
            x = _layer_stream(draft.layers[0], draft.fc(torch.cat([emb, feat], -1)), positions, draft.rope, kv[0],
                              mask)
        for layer, layer_kv in zip(draft.layers[1:], kv[1:]):
            x = _layer_stream(layer, x, positions, draft.rope, layer_kv, mask)
        outs.append(x)
        # the next stream's feature at p is this stream's output at p - 1 (zero at p = 0: no chain is rooted there)
        feat = torch.cat([torch.zeros_like(feat[:, :1]), x[:, :-1].to(feat.dtype)], 1)
    return outs


def unrolled_loss(target, draft: EagleDraft, emb, feats, pos, tgt_sel, tlog, lmask, cfg: "TrainConfig"):
    """The distillation loss over the draft's own rollouts (training-time test, as EAGLE-3 and HASS train): stream d
    (the draft's d-th chain step, fed its own features from step d-1) at position p is held to the same target as
    stream 1, where its chain's root p - d + 1 exists. The streams' losses are weighted by `unroll_decay`^(d-1) and
    normalised by the weights' sum; `unroll=1` is the plain EAGLE-1 loss. Returns (loss, depth-1 LossOut)."""
    with _autocast(feats.device, cfg.amp):
        outs = (unrolled_streams(draft, emb, feats, pos, cfg.unroll) if cfg.unroll > 1
                else [draft(emb, draft.read_features(feats), pos)])
    col = lmask.nonzero()[:, 1] if cfg.unroll > 1 else None
    total, wsum, first = 0.0, 0.0, None
    for d, out in enumerate(outs):
        with _autocast(feats.device, cfg.amp):
            o_sel = out[lmask]
            dlog = target.compute_logits(o_sel.to(tgt_sel.dtype))
        valid = None if d == 0 else col >= d
        lo = distill_loss(o_sel, tgt_sel, dlog, tlog, valid, cfg.w_ce, cfg.w_l1, cfg.ce_temperature, cfg.w_hard)
        w = cfg.unroll_decay ** d
        total = total + w * lo.loss
        wsum += w
        if first is None:
            first = lo
    return total / wsum, first


@torch.no_grad()
def evaluate(target, drafts: list[EagleDraft], examples: list[Example], cfg: TrainConfig, device,
             tokenizer=None) -> list[dict]:
    """Held-out loss, top-1 accuracy by depth and chain:3 TPC, for each draft."""
    amp = cfg.amp
    was_training = [d.training for d in drafts]
    for d in drafts:
        d.eval()
    exs = examples if cfg.eval_conversations is None else examples[: cfg.eval_conversations]
    res = [{"loss": 0.0, "ce": 0.0, "l1": 0.0, "n": 0.0, "correct": [0.0] * cfg.eval_depth,
            "count": [0.0] * cfg.eval_depth} for _ in drafts]
    for batch in length_batches([len(e) for e in exs], cfg.eval_batch_tokens):  # similar lengths, within budget
        ids, amask = collate(exs, batch)
        ids, amask = ids.to(device), amask.to(device)
        emb, feats, pos, tgt_h, lmask = draft_inputs(target, ids, amask, shared_feature_layers(drafts))
        with _autocast(device, amp):
            tlog_all = None
            for k, d in enumerate(drafts):
                outs = unrolled_streams(d, emb, feats, pos, cfg.eval_depth)
                r = res[k]
                sel = lmask
                if tlog_all is None:
                    tlog_all = target.compute_logits(tgt_h[sel])  # target logits at t+1, for all depths
                    tsel_idx = sel.nonzero()
                out1 = outs[0][sel]
                lo = distill_loss(out1, tgt_h[sel], target.compute_logits(out1.to(tgt_h.dtype)), tlog_all,
                                  None, cfg.w_ce, cfg.w_l1, cfg.ce_temperature, cfg.w_hard)
                n = float(lo.count)
                r["loss"] += float(lo.loss) * n
                r["ce"] += float(lo.ce) * n
                r["l1"] += float(lo.l1) * n
                r["n"] += n
                t_arg = tlog_all.argmax(-1)
                for dep, o in enumerate(outs):
                    # stream dep+1 at index p is rooted at p - dep: valid where that root exists
                    valid = tsel_idx[:, 1] >= dep
                    d_arg = target.compute_logits(o[sel].to(tgt_h.dtype)).argmax(-1)
                    r["correct"][dep] += float(((d_arg == t_arg) & valid).sum())
                    r["count"][dep] += float(valid.sum())
    out = []
    for r in res:
        n = max(r["n"], 1.0)
        out.append({"loss": r["loss"] / n, "ce": r["ce"] / n, "l1": r["l1"] / n, "positions": int(r["n"]),
                    "acc_by_depth": [c / max(m, 1.0) for c, m in zip(r["correct"], r["count"])]})
    if cfg.tpc_prompts > 0:
        for k, d in enumerate(drafts):
            out[k].update(tpc_eval(target, d, examples, tokenizer, cfg.tpc_prompts, cfg.tpc_max_tokens))
    for d, w in zip(drafts, was_training):
        d.train(w)
    return out


def tpc_eval(target, draft: EagleDraft, examples: list[Example], tokenizer, n_prompts: int, max_tokens: int,
             speculation: str = "chain:3") -> dict:
    """TPC of `speculation` through the engine, greedy, on the first turns of held-out conversations."""
    from eyas.engine.engine import EngineConfig, LLMEngine
    from eyas.sampling_params import SamplingParams
    from eyas.spec.tree import resolve_tree

    limit = target.config.max_position_embeddings - max_tokens - 16
    prompts = [p for p in (e.prompt_ids() for e in examples) if 0 < len(p) <= min(limit, 1024)][:n_prompts]
    if not prompts:
        return {}
    p = next(target.parameters())
    d = copy.deepcopy(draft).to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
    need = sum(len(x) + max_tokens + 16 for x in prompts)
    engine = LLMEngine(target, tokenizer, d, resolve_tree(speculation),
                       EngineConfig(num_blocks=need // 16 + len(prompts) * 2 + 8, max_num_seqs=len(prompts)))
    seqs = [engine.add_request(x, SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)) for x in prompts]
    while engine.has_unfinished():
        engine.step()
    calls = sum(s.stats.target_calls for s in seqs)
    committed = sum(s.stats.committed for s in seqs)
    del engine, d
    return {f"tpc_{speculation}": committed / max(calls, 1), "tpc_prompts": len(prompts)}


# ---- checkpoints -------------------------------------------------------------------------------------------------

def _ckpt_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.out) / "checkpoints"


def latest_checkpoint(cfg: TrainConfig) -> Path | None:
    files = sorted(_ckpt_dir(cfg).glob("step-*.pt"))
    return files[-1] if files else None


def save_checkpoint(cfg, state: dict) -> Path:
    d = _ckpt_dir(cfg)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{state['step']:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    old = sorted(d.glob("step-*.pt"))
    for f in old[: max(len(old) - cfg.keep_checkpoints, 0)]:
        f.unlink()
    return path


# ---- the loop ----------------------------------------------------------------------------------------------------

def _out_dirs(cfg: TrainConfig) -> list[Path]:
    if len(cfg.layers) == 1:
        return [Path(cfg.out)]
    return [Path(cfg.out) / f"layers-{L}" for L in cfg.layers]


def train(cfg: TrainConfig, target=None, tokenizer=None, train_examples: list[Example] | None = None,
          heldout_examples: list[Example] | None = None) -> dict:
    """Train draft(s); returns the summary also written to training.json. `target`/`tokenizer`/examples may be
    given (tests, several runs in one process); otherwise they are loaded from cfg."""
    from eyas.loader.eagle import save_draft
    from eyas.loader.resolve import load_target, resolve_device

    t_start = time.perf_counter()
    if cfg.answer_tokens is not None and cfg.answer_tokens < 1:
        raise ValueError(f"--answer-tokens must be >= 1, got {cfg.answer_tokens}")
    if not cfg.ce_temperature > 0:
        raise ValueError(f"--ce-temperature must be > 0, got {cfg.ce_temperature}")
    if cfg.w_hard < 0:
        raise ValueError(f"--w-hard must be >= 0, got {cfg.w_hard}")
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if target is None:  # loaded on the CPU first: the data is tokenised by forked workers before CUDA starts
        target, tokenizer = load_target(cfg.target, "cpu", _dtype(cfg.target_dtype, device))
    target.eval().requires_grad_(False)
    t_loaded = time.perf_counter()
    if train_examples is None:
        if not cfg.data:
            raise ValueError("no training data: give --data FILE.jsonl[.gz] ...")
        exs = load_examples(cfg.data, tokenizer, cfg.max_len, cfg.limit, target.config.vocab_size)
        if len(exs) < 2:
            raise ValueError(f"the data has {len(exs)} usable conversations; need at least 2")
        train_examples, held = split_heldout(exs, cfg.heldout, cfg.seed)
        heldout_examples = held if heldout_examples is None else heldout_examples
    heldout_examples = heldout_examples or []  # evaluated on whole answers, comparable across runs
    if cfg.answer_tokens is not None:
        train_examples = [x for e in train_examples
                          if (x := first_answer_tokens(e, cfg.answer_tokens)) is not None]
    target.to(device)
    if cfg.fast_target if cfg.fast_target is not None else device.type == "cuda":
        # the frozen target's pass (most of a step) on the fused inference kernels: faster, and the draft learns the
        # features exactly as the engine computes them on the GPU. Gradients never flow through the target, and
        # with autograd on (the draft) the eager reference runs anyway (`eyas.models.llama.takes_fused_path`).
        from eyas.models.fused import enable_fast_path
        enable_fast_path(target)
    t_data = time.perf_counter()
    if not train_examples:
        raise ValueError("no training examples")
    for L in cfg.layers:
        if not 1 <= L <= 3:
            raise ValueError(f"--layers must be 1, 2 or 3, got {L}")
    if not 1 <= cfg.unroll <= 8:
        raise ValueError(f"--unroll must be between 1 and 8, got {cfg.unroll}")
    if cfg.unroll_decay <= 0:
        raise ValueError(f"--unroll-decay must be > 0, got {cfg.unroll_decay}")

    # drafts, optimisers, schedules
    torch.manual_seed(cfg.seed)
    drafts = []
    fl = tuple(cfg.feature_layers) if cfg.feature_layers is not None else None
    for L in cfg.layers:
        d = make_draft(target, L, fl, cfg.draft_intermediate)
        if cfg.init is not None:
            init_from_checkpoint(d, Path(cfg.init))
        drafts.append(d.to(device=device, dtype=torch.float32).train())
    opts = [torch.optim.AdamW(d.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                              weight_decay=cfg.weight_decay) for d in drafts]
    lengths = [len(e) for e in train_examples]
    per_epoch = [len(plan_epoch(lengths, cfg.batch_tokens, cfg.max_batch, cfg.seed, e)) for e in range(cfg.epochs)]
    total = sum(per_epoch)
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * total))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(total, warmup, cfg.min_lr_ratio)) for o in opts]
    noise_gen = torch.Generator(device=device)
    noise_gen.manual_seed(cfg.seed + 1)

    step, epoch0, batch0 = 0, 0, 0
    history: list[dict] = []
    evals: list[dict] = []
    tokens_seen = 0
    train_time = 0.0
    resume = cfg.resume
    if resume == "auto":
        resume = latest_checkpoint(cfg)
    if resume:
        ck = torch.load(resume, map_location="cpu", weights_only=False)
        if ck["layers"] != list(cfg.layers):
            raise ValueError(f"checkpoint {resume} trains layers {ck['layers']}, not {cfg.layers}")
        ck_cfg = ck.get("config", {})  # older checkpoints have no config: they trained on whole answers
        if ck_cfg.get("answer_tokens") != cfg.answer_tokens:
            raise ValueError(f"checkpoint {resume} trains on answer tokens {ck_cfg.get('answer_tokens')}, "
                             f"not {cfg.answer_tokens}")
        ck_fl = ck_cfg.get("feature_layers")
        if (list(ck_fl) if ck_fl is not None else None) != (list(fl) if fl is not None else None):
            raise ValueError(f"checkpoint {resume} reads feature layers {ck_fl}, not {cfg.feature_layers}")
        for d, s in zip(drafts, ck["drafts"]):
            d.load_state_dict(s)
        for o, s in zip(opts, ck["optims"]):
            o.load_state_dict(s)
        for sc, s in zip(scheds, ck["scheds"]):
            sc.load_state_dict(s)
        _set_rng_state(ck["rng"], noise_gen)
        step, epoch0, batch0 = ck["step"], ck["epoch"], ck["batch"]
        history, evals = ck["history"], ck["evals"]
        tokens_seen, train_time = ck["tokens_seen"], ck["train_time"]

    def checkpoint(epoch, batch):
        return save_checkpoint(cfg, {
            "step": step, "epoch": epoch, "batch": batch, "layers": list(cfg.layers),
            "drafts": [d.state_dict() for d in drafts], "optims": [o.state_dict() for o in opts],
            "scheds": [s.state_dict() for s in scheds], "rng": _rng_state(noise_gen), "history": history,
            "evals": evals, "tokens_seen": tokens_seen, "train_time": train_time, "config": asdict(cfg)})

    def run_eval():
        if not heldout_examples:
            return
        st = _rng_state(noise_gen)  # evaluation must not disturb the training RNG streams
        with attention_backends(device):
            res = evaluate(target, drafts, heldout_examples, cfg, device, tokenizer)
        _set_rng_state(st, noise_gen)
        evals.append({"step": step, "drafts": {f"layers-{L}": r for L, r in zip(cfg.layers, res)}})
        msg = "; ".join(f"L{L}: loss {r['loss']:.4f} acc@depth " + "/".join(f"{a:.3f}" for a in r["acc_by_depth"])
                        + (f" tpc(chain:3) {r['tpc_chain:3']:.3f}" if "tpc_chain:3" in r else "")
                        for L, r in zip(cfg.layers, res))
        tqdm.write(f"[eval step {step}] {msg}")

    pad_multiple = cfg.pad_multiple or (64 if device.type == "cuda" else 1)
    pending: list[tuple[dict, torch.Tensor]] = []

    def flush():
        """Fill the pending history records with their losses, read back from the device in one transfer."""
        if not pending:
            return
        vals = torch.stack([t for _, t in pending]).tolist()
        for (rec, _), per_draft in zip(pending, vals):
            for L, (loss, ce, l1, correct, count, gn) in zip(cfg.layers, per_draft):
                rec[f"layers-{L}"].update(loss=loss, ce=ce, l1=l1, acc=correct / max(count, 1.0), grad_norm=gn)
        pending.clear()

    if step == 0 and cfg.eval_every:
        run_eval()
    tty = sys.stderr.isatty()
    bar = tqdm(total=total, initial=step, disable=not cfg.progress, desc="train-draft", dynamic_ncols=True,
               mininterval=0.5 if tty else 15.0)
    stopped = None
    epoch, bi = epoch0, batch0
    t_window, tok_window = time.perf_counter(), 0
    try:
        for epoch in range(epoch0, cfg.epochs):
            plan = plan_epoch(lengths, cfg.batch_tokens, cfg.max_batch, cfg.seed, epoch)
            bi = batch0 if epoch == epoch0 else 0
            while bi < len(plan) and step < total:
                t0 = time.perf_counter()
                ids, amask = collate(train_examples, plan[bi], multiple=pad_multiple)
                ntok = sum(lengths[i] for i in plan[bi])
                if device.type == "cuda":
                    ids, amask = ids.pin_memory(), amask.pin_memory()
                ids, amask = ids.to(device, non_blocking=True), amask.to(device, non_blocking=True)
                with attention_backends(device):
                    emb, feats, pos, tgt_h, lmask = draft_inputs(target, ids, amask, cfg.feature_layers)
                    feats = _noise(feats, cfg.noise, cfg.noise_std, noise_gen)
                    tgt_sel = tgt_h[lmask]
                    with torch.no_grad():
                        tlog = target.compute_logits(tgt_sel)
                    rec = {"step": step + 1, "tokens": ntok, "positions": int(tgt_sel.shape[0])}
                    stats = []
                    for L, d, o, sc in zip(cfg.layers, drafts, opts, scheds):
                        loss, lo = unrolled_loss(target, d, emb, feats, pos, tgt_sel, tlog, lmask, cfg)
                        o.zero_grad(set_to_none=True)
                        loss.backward()
                        gn = torch.nn.utils.clip_grad_norm_(d.parameters(), cfg.grad_clip)
                        o.step()
                        rec[f"layers-{L}"] = {"lr": sc.get_last_lr()[0]}
                        sc.step()
                        # read back later, in one transfer for many steps: no host sync per step
                        stats.append(torch.stack([loss.detach(), lo.ce, lo.l1, lo.correct, lo.count,
                                                  gn.to(lo.loss.device)]).float())
                        del loss, lo
                pending.append((rec, torch.stack(stats)))
                step += 1
                bi += 1
                tokens_seen += ntok
                tok_window += ntok
                history.append(rec)
                now = time.perf_counter()
                if now - t_window > 2.0 or step >= total:
                    flush()
                    first = rec[f"layers-{cfg.layers[0]}"]
                    rate = tok_window / (now - t_window)
                    t_window, tok_window = now, 0
                    bar.set_postfix(loss=f"{first['loss']:.4f}", acc=f"{first['acc']:.3f}", tok_s=f"{rate:,.0f}",
                                    refresh=False)
                dt = time.perf_counter() - t0
                train_time += dt
                bar.update(1)
                if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                    flush()
                    run_eval()
                if cfg.save_every and step % cfg.save_every == 0 and step < total:
                    flush()
                    checkpoint(epoch, bi)
                if cfg.stop_after is not None and step >= cfg.stop_after and step < total:
                    stopped = f"stop_after={cfg.stop_after}"
                elif cfg.time_budget is not None and train_time >= cfg.time_budget and step < total:
                    stopped = f"time_budget={cfg.time_budget}s"
                if stopped:
                    break
            if stopped or step >= total:
                break
    finally:
        flush()
        bar.close()
    if bi >= len(plan_epoch(lengths, cfg.batch_tokens, cfg.max_batch, cfg.seed, epoch)):
        epoch, bi = epoch + 1, 0
    ck_path = checkpoint(epoch, bi)
    if stopped is None:
        run_eval()

    # outputs
    final = evals[-1]["drafts"] if evals else {}
    summary_common = {
        "target": cfg.target, "data": [str(p) for p in cfg.data], "train_conversations": len(train_examples),
        "heldout_conversations": len(heldout_examples), "epochs": cfg.epochs, "steps": step, "schedule_steps": total,
        "warmup_steps": warmup, "finished": stopped is None, "stopped": stopped, "init": cfg.init,
        "tokens_seen": tokens_seen,
        "train_seconds": round(train_time, 2), "tokens_per_second": round(tokens_seen / max(train_time, 1e-9), 1),
        "wall_seconds": round(time.perf_counter() - t_start, 2),
        "load_seconds": round(t_loaded - t_start, 2), "data_seconds": round(t_data - t_loaded, 2),
        "loss_weights": {"w_ce": cfg.w_ce, "w_l1": cfg.w_l1, "ce_temperature": cfg.ce_temperature,
                         "w_hard": cfg.w_hard},
        "unroll": {"steps": cfg.unroll, "decay": cfg.unroll_decay},
        "feature_layers": list(fl) if fl is not None else None,
        "answer_tokens": cfg.answer_tokens,
        "optimizer": {"name": "AdamW", "lr": cfg.lr, "betas": [cfg.beta1, cfg.beta2],
                      "weight_decay": cfg.weight_decay, "schedule": "linear warm-up + cosine",
                      "min_lr_ratio": cfg.min_lr_ratio, "grad_clip": cfg.grad_clip},
        "noise": {"kind": cfg.noise, "std": cfg.noise_std}, "batch_tokens": cfg.batch_tokens, "max_len": cfg.max_len,
        "seed": cfg.seed, "device": str(device) + (f" ({torch.cuda.get_device_name(device)})"
                                                   if device.type == "cuda" else ""),
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "amp": bool(cfg.amp and device.type == "cuda"), "checkpoint": str(ck_path),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
    }
    outs = _out_dirs(cfg)
    per_draft = {}
    for L, d, od in zip(cfg.layers, drafts, outs):
        key = f"layers-{L}"
        if step > 0:
            save_draft(d, od, dtype=_dtype(cfg.save_dtype, torch.device("cpu")))
        info = dict(summary_common, layers=L, final_metrics=final.get(key, {}),
                    final_train_loss=history[-1][key]["loss"] if history else None,
                    evals=[{"step": e["step"], **e["drafts"][key]} for e in evals])
        od.mkdir(parents=True, exist_ok=True)
        (od / "training.json").write_text(json.dumps(info, indent=2))
        per_draft[key] = info
    summary = dict(summary_common, layers=list(cfg.layers), final_metrics=final, outputs=[str(o) for o in outs])
    summary["loss_curve"] = [{"step": h["step"], **{k: v["loss"] for k, v in h.items() if k.startswith("layers-")}}
                             for h in history]
    if len(outs) > 1:
        (Path(cfg.out) / "training.json").write_text(json.dumps(summary, indent=2))
    with open(Path(cfg.out) / "metrics.jsonl", "w") as f:
        for h in history:
            f.write(json.dumps(h) + "\n")
        for e in evals:
            f.write(json.dumps({"eval": e}) + "\n")
    summary["history"] = history
    summary["evals"] = evals
    return summary


# ---- CLI ---------------------------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `train-draft` on the eyas CLI's subparsers."""
    d = TrainConfig()
    p = subparsers.add_parser("train-draft", help="train an EAGLE draft by online distillation from the target",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=d.target, help="'smollm2', an HF directory or a .gguf file")
    p.add_argument("--data", nargs="+", required=True, help="jsonl[.gz] files of conversations")
    p.add_argument("--layers", nargs="+", type=int, default=d.layers,
                   help="decoder layers of the draft (1, 2 or 3); several values train drafts side by side")
    p.add_argument("--out", required=True, help="output directory (EAGLE checkpoint + training.json)")
    p.add_argument("--device", default=d.device)
    p.add_argument("--target-dtype", default=d.target_dtype)
    p.add_argument("--no-amp", dest="amp", action="store_false", help="no bf16 autocast on CUDA")
    p.add_argument("--eager-target", dest="fast_target", action="store_false", default=None,
                   help="run the frozen target on the eager reference ops (default on CUDA: the fused kernels)")
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--limit", type=int, default=None, help="read at most N conversations")
    p.add_argument("--heldout", type=int, default=d.heldout, help="conversations kept out for evaluation")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--max-batch", type=int, default=d.max_batch)
    p.add_argument("--pad-multiple", type=int, default=d.pad_multiple,
                   help="round batch lengths up to a multiple of N (0: 64 on CUDA, 1 on the CPU)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--stop-after", type=int, default=None, help="stop and checkpoint at this step")
    p.add_argument("--time-budget", type=float, default=None, help="stop and checkpoint after N seconds of training")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--w-ce", type=float, default=d.w_ce)
    p.add_argument("--w-l1", type=float, default=d.w_l1)
    p.add_argument("--ce-temperature", type=float, default=d.ce_temperature,
                   help="sharpen the CE term's soft labels: softmax(target logits / T); < 1 leans towards the "
                        "target's argmax, which is all greedy acceptance needs (1: the paper's loss)")
    p.add_argument("--w-hard", type=float, default=d.w_hard,
                   help="weight of a CE term against the target's argmax (a hard label) beside the soft one "
                        "(0: none, the paper's loss)")
    p.add_argument("--feature-layers", nargs="+", type=int, default=None, metavar="I",
                   help="target layers (0-based) whose rms-normalised outputs the drafts also read, next to the final "
                        "hidden state (EAGLE-3 style; e.g. 3 15); default: the final hidden state only (EAGLE-1)")
    p.add_argument("--answer-tokens", type=int, default=None, metavar="N",
                   help="train on the first N tokens of each assistant turn only, where a chat answer's speculation "
                        "is judged (held-out evaluation still covers whole answers); default: all")
    p.add_argument("--unroll", type=int, default=d.unroll,
                   help="train on the draft's own rollouts: chain steps 1..N, step d fed the draft's features from "
                        "step d-1 (EAGLE-3's training-time test); 1: plain EAGLE-1 training")
    p.add_argument("--unroll-decay", type=float, default=d.unroll_decay,
                   help="weight of chain step d's loss is DECAY^(d-1)")
    p.add_argument("--noise", choices=["none", "uniform", "gaussian"], default=d.noise)
    p.add_argument("--noise-std", type=float, default=d.noise_std)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--init", default=None,
                   help="start from this EAGLE checkpoint (drafts with more layers or a wider MLP grow from it)")
    p.add_argument("--draft-intermediate", type=int, default=None, metavar="N",
                   help="the drafts' MLP width (default: the target's intermediate size). Where a draft step is "
                        "bound by kernel launches (small models at batch 1), a wider MLP costs it little time")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-depth", type=int, default=d.eval_depth)
    p.add_argument("--eval-conversations", type=int, default=None)
    p.add_argument("--tpc-prompts", type=int, default=d.tpc_prompts)
    p.add_argument("--tpc-max-tokens", type=int, default=d.tpc_max_tokens)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--resume", default=None, help="a checkpoint file, or 'auto' for the latest under OUT")
    p.add_argument("--save-dtype", default=d.save_dtype, choices=["bfloat16", "float32", "float16"])
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)
    return p


def config_from_args(args) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args) -> int:
    cfg = config_from_args(args)
    summary = train(cfg)
    final = summary["final_metrics"]
    print(json.dumps({"outputs": summary["outputs"], "steps": summary["steps"],
                      "tokens_per_second": summary["tokens_per_second"], "train_seconds": summary["train_seconds"],
                      "wall_seconds": summary["wall_seconds"], "final_metrics": final}, indent=2))
    return 0


def main(argv=None) -> int:
    from eyas.cli import subcommand_main
    return subcommand_main(add_parser, "train-draft", "eyas.train.trainer", argv)


if __name__ == "__main__":
    sys.exit(main())
