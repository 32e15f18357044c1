"""Tensor parallelism as a transform applied after loading (gpt-fast style): the model code does not know about it.

`apply_tensor_parallel(model, rank, world_size, group)` shards a loaded `LlamaForCausalLM` (or an `EagleDraft`) in
place, for rank `rank` of `world_size` (before `eyas.models.fused.fuse_projections`, which then fuses each rank's
shards; the runner does it after sharding):

* attention: q/k/v are column-parallel *by heads* (rank r keeps query heads [r*nh/W, (r+1)*nh/W) and kv heads
  [r*nkv/W, (r+1)*nkv/W), which keeps every query head with its GQA kv head); o_proj is row-parallel and its output
  is all-reduced (a forward hook). The attention modules' `n_heads`/`n_kv` and the model's config *copy* are updated,
  so the runner allocates a KV cache holding only this rank's kv heads.
* MLP: gate/up are column-parallel, down is row-parallel with an all-reduce.
* embedding: vocabulary-parallel (rank r holds rows [r*Vs, (r+1)*Vs), Vs = ceil(V/W); ids outside give zeros; the
  partial embeddings are all-reduced). LM head: vocabulary-parallel, each rank computes its slice of the logits and
  they are **all-gathered, so every rank holds the full float logits**. A tied head shares the embedding's shard.

Synchronised sampling: every rank holds the same gathered logits (an all-reduce and an all-gather give the same bits
on every rank) and the sampler draws its randomness from a pure function of (request seed, position)
(`eyas.layers.sampler.uniform`), so every rank makes the same acceptance decision and samples the same tokens, with no
broadcast of the decision. Top-k/top-p therefore run over the full vocabulary, as at TP = 1.

The biases of row-parallel layers stay on rank 0 only (added once to the sum).

The EAGLE draft is small (one decoder layer) and is kept *replicated* by default: every rank runs it whole, on the
target's (all-reduced, hence identical) hidden states, using the target's sharded embedding and LM head, which are
collectives every rank calls in the same order. `apply_tensor_parallel` also shards a draft, if one wants that.

`TPEngine` runs one `LLMEngine` per rank in lockstep: rank 0 receives requests and broadcasts them before each step;
every rank's scheduler is deterministic given the same requests, so all ranks schedule the same batches.
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from eyas.models.eagle import EagleDraft
from eyas.models.llama import Attention, LlamaForCausalLM, MLP


# ---- layers ---------------------------------------------------------------------------------------------------
def _all_reduce_hook(group):
    def hook(module, args, out):
        dist.all_reduce(out, group=group)
        return out
    return hook


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; other ids give zeros; the partial results are all-reduced."""

    def __init__(self, weight_shard: torch.Tensor, start: int, end: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight_shard, requires_grad=False)
        self.start, self.end, self.group = start, end, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """Logits of vocabulary rows [start, end) on each rank, all-gathered: every rank returns the full [N, V] logits.

    Shards are padded to a common size `shard` (the last one may be short when W does not divide V)."""

    def __init__(self, weight_shard: torch.Tensor | nn.Parameter, start: int, end: int, shard: int, vocab: int,
                 world_size: int, group=None):
        super().__init__()
        self.weight = weight_shard if isinstance(weight_shard, nn.Parameter) else nn.Parameter(weight_shard, False)
        self.start, self.end, self.shard, self.vocab, self.world_size, self.group = (start, end, shard, vocab,
                                                                                    world_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)
        if local.shape[-1] < self.shard:
            local = F.pad(local, (0, self.shard - local.shape[-1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


# ---- the transform --------------------------------------------------------------------------------------------
def _rows(linear: nn.Linear, start: int, end: int) -> None:
    """Column parallelism: keep output features [start, end)."""
    linear.weight = nn.Parameter(linear.weight.data[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _cols(linear: nn.Linear, start: int, end: int, rank: int, group) -> None:
    """Row parallelism: keep input features [start, end); the bias only on rank 0; all-reduce the output."""
    linear.weight = nn.Parameter(linear.weight.data[:, start:end].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = end - start
    linear.register_forward_hook(_all_reduce_hook(group))


def _shard_attention(attn: Attention, rank: int, W: int, group) -> None:
    nh, nkv, D = attn.n_heads, attn.n_kv, attn.head_dim
    if nh % W or nkv % W:
        raise ValueError(f"tensor parallelism {W} needs the attention heads ({nh}) and the key/value heads ({nkv}) "
                         f"to be divisible by {W}")
    qh, kvh = nh // W, nkv // W
    _rows(attn.q_proj, rank * qh * D, (rank + 1) * qh * D)
    _rows(attn.k_proj, rank * kvh * D, (rank + 1) * kvh * D)
    _rows(attn.v_proj, rank * kvh * D, (rank + 1) * kvh * D)
    _cols(attn.o_proj, rank * qh * D, (rank + 1) * qh * D, rank, group)
    attn.n_heads, attn.n_kv = qh, kvh


def _shard_mlp(mlp: MLP, rank: int, W: int, group) -> None:
    inter = mlp.gate_proj.out_features
    if inter % W:
        raise ValueError(f"tensor parallelism {W} needs the MLP width ({inter}) to be divisible by {W}")
    s = inter // W
    _rows(mlp.gate_proj, rank * s, (rank + 1) * s)
    _rows(mlp.up_proj, rank * s, (rank + 1) * s)
    _cols(mlp.down_proj, rank * s, (rank + 1) * s, rank, group)


def _check_heads(cfg, W: int, what: str) -> None:
    if cfg.num_attention_heads % W or cfg.num_key_value_heads % W:
        raise ValueError(f"{what}: tensor parallelism {W} needs the attention heads ({cfg.num_attention_heads}) and "
                         f"the key/value heads ({cfg.num_key_value_heads}) to be divisible by {W}")
    if cfg.intermediate_size % W:
        raise ValueError(f"{what}: tensor parallelism {W} needs the MLP width ({cfg.intermediate_size}) to be "
                         f"divisible by {W}")


def apply_tensor_parallel(model: LlamaForCausalLM | EagleDraft, rank: int, world_size: int, group=None):
    """Shard `model` in place for `rank` of `world_size` (see the module docstring) and return it.

    The forward passes then issue collectives on `group` (default: the world group), so every rank of the group must
    run the same forwards in the same order. Call it after loading (weights already on the rank's device) and after
    `torch.distributed.init_process_group`. World size 1 returns the model untouched.

    After it, `compute_logits` returns the full logits on every rank (all-gathered): acceptance and sampling, which
    draw from (seed, position) only, agree on every rank without a broadcast.
    """
    W = world_size
    if W == 1:
        return model
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} is outside world size {W}")
    if getattr(model, "_tp_world_size", 1) != 1:
        raise ValueError("this model is already sharded")
    from eyas.models.fused import is_fused
    if is_fused(model):
        raise ValueError("shard the model before fusing its projections (eyas.models.fused.fuse_projections)")
    what = type(model).__name__
    _check_heads(model.config, W, what)
    layers = model.model.layers if isinstance(model, LlamaForCausalLM) else model.layers
    for layer in layers:
        _shard_attention(layer.self_attn, rank, W, group)
        _shard_mlp(layer.mlp, rank, W, group)
    model.config = dataclasses.replace(model.config,
                                       num_attention_heads=model.config.num_attention_heads // W,
                                       num_key_value_heads=model.config.num_key_value_heads // W,
                                       intermediate_size=model.config.intermediate_size // W)
    if isinstance(model, LlamaForCausalLM):
        V = model.config.vocab_size
        shard = -(-V // W)
        start, end = min(rank * shard, V), min((rank + 1) * shard, V)
        emb = model.model.embed_tokens.weight
        tied = model.lm_head.weight is emb
        model.model.embed_tokens = VocabParallelEmbedding(emb.data[start:end].clone(), start, end, group)
        head_w = model.model.embed_tokens.weight if tied else model.lm_head.weight.data[start:end].clone()
        model.lm_head = VocabParallelHead(head_w, start, end, shard, V, W, group)
    model._tp_rank, model._tp_world_size = rank, W
    return model


# ---- engine-level lockstep --------------------------------------------------------------------------------------
class TPEngine:
    """One `LLMEngine` per rank, stepped in lockstep.

    Scheduling scheme: rank 0 is the only rank that receives requests (`add_request`, `abort`). At the start of each
    `step()` it broadcasts the operations queued since the last step (`broadcast_object_list`), every rank applies
    them to its own engine in the same order, then steps it. Each rank's scheduler is deterministic given the same
    requests (no clocks, no randomness), so all ranks schedule the same batches and issue the same collectives; the
    sampler is a pure function of (seed, position) over identical gathered logits, so they commit the same tokens.
    Rank 0 fixes a missing seed before broadcasting (a per-rank random seed would make ranks diverge).

    `check=True` all-gathers each step's outputs (request ids and new tokens) and raises if ranks disagree: a cheap
    guard for tests and debugging, not needed in production.
    """

    def __init__(self, engine, rank: int, world_size: int, group=None, check: bool = False):
        self.engine, self.rank, self.world_size, self.group, self.check = engine, rank, world_size, group, check
        self._ops: list[tuple] = []
        self._ids = 0
        self._stopped = False
        self.last_errors: list[tuple[str, str]] = []  # (request id, reason) of requests refused at the last step

    # rank 0 only
    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        from eyas.sampling_params import SamplingParams
        if self.rank != 0:
            raise RuntimeError("only rank 0 receives requests")
        params = params or SamplingParams()
        if params.seed is None:
            params = dataclasses.replace(params, seed=random.getrandbits(62))
        ids = self.engine.encode(prompt)  # tokenise once, on rank 0
        if request_id is None:
            request_id = f"tp-{self._ids}"
            self._ids += 1
        self._ops.append(("add", request_id, ids, params))
        return request_id

    def abort(self, request_id: str) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 receives requests")
        self._ops.append(("abort", request_id))

    def stop(self) -> None:
        """Rank 0: make every rank's `step()` return None from the next step on (a serving loop's exit)."""
        self._ops.append(("stop",))

    def _sync_ops(self) -> list[tuple]:
        box: list[Any] = [self._ops if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        self._ops = []
        return box[0]

    def step(self):
        """Collective: every rank calls it. Returns this step's `RequestOutput`s (the same on every rank), or None
        once rank 0 has called `stop()`."""
        if self._stopped:
            return None
        errors = []
        for op in self._sync_ops():
            if op[0] == "add":
                _, rid, ids, params = op
                try:
                    self.engine.add_request(ids, params, request_id=rid)
                except ValueError as e:  # the same on every rank: reported on rank 0
                    errors.append((rid, str(e)))
            elif op[0] == "abort":
                self.engine.abort(op[1])
            elif op[0] == "stop":
                self._stopped = True
                return None
        self.last_errors = errors
        outputs = self.engine.step()
        if self.check and self.world_size > 1:
            sig = [(o.request_id, o.new_token_ids, o.finished) for o in outputs]
            sigs: list[Any] = [None] * self.world_size
            dist.all_gather_object(sigs, sig, group=self.group)
            if any(s != sigs[0] for s in sigs):
                raise RuntimeError(f"tensor-parallel ranks diverged: {sigs}")
        return outputs

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def generate(self, prompts=None, params=None) -> list[list[int]]:
        """Collective offline generation: rank 0 passes the prompts (token-id lists or strings) and params (one or a
        list); other ranks pass nothing. Every rank returns the new token ids of each prompt, in order."""
        if self.rank == 0:
            from eyas.sampling_params import SamplingParams
            plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
            rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        box: list[Any] = [rids if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        rids = box[0]
        results: dict[str, list[int]] = {}
        first = True
        while first or self.engine.has_unfinished():
            first = False
            for out in self.step():
                if out.finished:
                    results[out.request_id] = out.token_ids
        for rid, err in self.last_errors:
            raise ValueError(f"request {rid}: {err}")
        return [results.get(r, []) for r in rids]


class TPServingEngine:
    """Rank 0's `LLMEngine` face of a `TPEngine`, for the server's engine loop (`eyas.serve.async_engine`), which
    calls `add_request`, `abort`, `has_unfinished` and `step` from its one loop thread and reads the engine's state
    (tokenizer, scheduler, blocks, step counts, ...: rank 0's own engine, forwarded).

    * `add_request` checks the request on rank 0 at once (a bad one raises ValueError there, as LLMEngine does, so
      the client gets its 4xx) and queues it for every rank's next step.
    * `has_unfinished` is also true while operations are queued, and once `heartbeat_s` has passed since the last
      step: an idle server still steps (an empty broadcast) every ~second, so the other ranks, which wait in that
      broadcast, never reach the process group's timeout.
    * A request that every rank refuses at its step (it passed rank 0's check, so this is not expected) comes back
      as a finished output with finish_reason "error": the loop never waits for a request that will not run.
    * `close()` stops every rank (their `TPEngine.step` returns None); call it after the loop thread has stopped.
    """

    def __init__(self, tp: TPEngine, heartbeat_s: float = 0.5):
        if tp.rank != 0:
            raise ValueError("only rank 0 serves")
        self.tp, self.local, self.heartbeat_s = tp, tp.engine, heartbeat_s
        self._last_step = time.monotonic()

    def __getattr__(self, name):  # tokenizer, tree, draft, blocks, scheduler, step_counts, max_model_len, ...
        return getattr(self.local, name)

    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        if request_id is not None and any(op[0] == "add" and op[1] == request_id for op in self.tp._ops):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.local.check_request(prompt, request_id)
        return self.tp.add_request(ids, params, request_id)

    def abort(self, request_id: str) -> None:
        self.tp.abort(request_id)

    def has_unfinished(self) -> bool:
        return (bool(self.tp._ops) or self.local.has_unfinished()
                or time.monotonic() - self._last_step > self.heartbeat_s)

    def step(self):
        from eyas.engine.engine import RequestOutput
        self._last_step = time.monotonic()
        outs = self.tp.step()
        if outs is None:
            return []
        return outs + [RequestOutput(rid, [], True, "error", 0) for rid, _ in self.tp.last_errors]

    def close(self) -> None:
        self.tp.stop()
        self.tp.step()


def build_tp_engine(model: str, draft: str | None, speculation: str | None, rank: int, world_size: int, device,
                    dtype="auto", check: bool = False, shard_draft: bool = True, **engine_kwargs) -> TPEngine:
    """This rank's `TPEngine` for `eyas generate/serve --tensor-parallel N`: the target sharded, the draft
    (`draft`: as `eyas.loader.resolve.resolve_draft_arg` returns it) sharded too (`shard_draft`, the default: 2.5-3%
    faster than replicated on the H200 x2, 8B and 70B shapes) or replicated, the speculation given or the draft's
    default for the device. `engine_kwargs` go to `EngineConfig` (cuda_graphs="auto": on a GPU)."""
    from eyas.engine.llm import build_engine
    from eyas.loader.resolve import draft_dir
    from eyas.spec.tree import resolve_tree
    from eyas.spec.ngram import ngram_proposer
    tree = resolve_tree(speculation)  # a bad name fails before anything loads
    proposer = ngram_proposer(draft)  # n-gram proposals: every rank makes the same ones from the same tokens
    if proposer is not None:
        draft = None
    if draft is not None:
        draft = draft_dir(model, draft)
    target, tok, draft_model = load_sharded(model, rank, world_size, device, dtype, draft=draft,
                                            shard_draft=shard_draft)
    draft_model = proposer if proposer is not None else draft_model
    return TPEngine(build_engine(target, tok, draft_model, tree, speculation, **engine_kwargs), rank, world_size,
                    check=check)


def load_sharded(model: str, rank: int, world_size: int, device="cpu", dtype="auto", draft: str | None = None,
                 group=None, shard_draft: bool = False):
    """Load a target (and optionally an EAGLE draft, replicated, or sharded like the target with `shard_draft`) for
    one rank. Returns (target, tokenizer, draft or None).

    An HF safetensors directory is read slice by slice (`eyas.loader.hf.load_hf_sharded`: each rank reads only the
    rows or columns it keeps, and copies them into its shard on `device`). Other checkpoints (a GGUF file, whose quantised blocks are not
    sliced) are read whole on the host, sharded, and only this rank's slices moved to `device`."""
    from eyas.loader.eagle import load_draft
    from eyas.loader.resolve import load_target, resolve_device, resolve_dtype
    dev = resolve_device(device) if isinstance(device, str) else device
    dt = resolve_dtype(dtype, dev)
    from pathlib import Path
    if Path(model).is_dir() and any(Path(model).glob("*.safetensors")):
        from eyas.loader.hf import load_hf_sharded
        target, tok = load_hf_sharded(model, rank, world_size, dev, dt, group)
    else:
        target, tok = load_target(model, "cpu", dt)
        apply_tensor_parallel(target, rank, world_size, group)
        target = target.to(dev)
    d = load_draft(draft, target) if draft is not None else None
    if d is not None and shard_draft:
        apply_tensor_parallel(d, rank, world_size, group)
    return target, tok, d
