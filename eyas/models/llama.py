"""Llama 3.x in plain PyTorch modules (RMSNorm, RoPE with llama3 scaling, GQA, SwiGLU, tied or untied head).

Parameter names follow HF's `LlamaForCausalLM`, so an HF state dict loads as it is. The forward takes a padded
[B, Q] block of new tokens and an `AttentionMetadata`, and returns the final hidden state after the final norm
(what EAGLE drafts consume); `compute_logits` applies the LM head.

The eager modules are the reference. For inference on a GPU, `eyas.models.fused` fuses q/k/v and gate/up into one
projection each and switches the forward to `DecoderLayer.forward_fused` (Triton kernels for residual add + RMSNorm,
RoPE and SwiGLU); see docs/kernels.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.cache.kv_cache import KVCache
from eyas.config import ModelConfig
from eyas.layers.attention import (AttentionMetadata, prefix_only_attention, split_tree_attention, store_rows,
                                   write_kv)
from eyas.layers.norm import RMSNorm, rms_normalize
from eyas.layers.rotary import RotaryEmbedding

# Programmatic dependent launch for the fused path's Triton kernels between its cuBLAS GEMMs: the RoPE + K/V store
# launch, the attention and its split reduction (each lets the next launch early, then waits for the previous one's
# writes), as the one-row and few-rows paths launch theirs. The GEMMs around them are ordinary launches, so only
# those two transitions can overlap. Timed on the H200 in session 22 (docs/benchmarks.md, "Session 22"): it lowered
# the step of SmolLM2's default tree (49-row verify passes) by 1.8-2.7% and the 8B shape's chain:3 step by 0.9-1.0%
# at batch 1, and left batch 32's speculative steps within their spread; but plain decoding at batch 32 (the fused
# path) went 3.5% slower for the 8B shape (3.2-3.4% faster for SmolLM2). So it is on for every fused pass except
# plain decode steps (`AttentionMetadata.prefix_includes_new`). `eyas.models.llama.FUSED_PDL = False` turns it off.
FUSED_PDL = True


def fused_pdl(device: torch.device) -> bool:
    """Whether the fused path asks its Triton kernels for PDL: `FUSED_PDL` on, and a GPU that has it (sm_90+)."""
    if not FUSED_PDL:
        return False
    from eyas.models import one_row
    return one_row.use_pdl(device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, D = cfg.hidden_size, cfg.head_dim
        qkv_bias = cfg.attention_bias or cfg.qkv_bias  # Qwen2: biases on q, k and v, none on o
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=qkv_bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=qkv_bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=cfg.attention_bias)
        if cfg.qk_norm:  # Qwen3: each q and k head RMS-normalised before RoPE
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.scale = D ** -0.5

    def fuse_projections(self) -> None:
        """Replace q/k/v by one `qkv_proj` (weights, and biases if any, concatenated; the originals freed): one GEMM
        instead of three. For inference, after loading (and after tensor-parallel sharding)."""
        if hasattr(self, "qkv_proj"):
            return
        self.qkv_proj = _concat_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_sizes = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x):
        """x [B, Q, H] -> q [B, Q, heads, D], k and v [B, Q, kv heads, D], before RoPE (views of one fused
        projection's output, or three separate ones; q and k normalised per head where the model does: Qwen3)."""
        B, Q, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = q.view(B, Q, self.n_heads, self.head_dim), k.view(B, Q, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(B, Q, self.n_kv, self.head_dim)

    def project(self, x, positions, rope: RotaryEmbedding, fused: bool = False):
        """`qkv` with RoPE applied to q and k (`fused`: by the Triton kernel; the reference otherwise)."""
        q, k, v = self.qkv(x)
        if fused:
            from eyas.kernels import rope_triton
            q, k = rope_triton(positions, q, k, rope.cos, rope.sin)
        else:
            q, k = rope(positions, q, k)
        return q, k, v

    def rope_store(self, x, positions, rope: RotaryEmbedding, k_dst, v_dst, fused: bool, norm=None, pdl=False,
                   **where):
        """`qkv`, then RoPE, with k (rotated) and v stored at once into the row stores k_dst/v_dst [R, KVH, D]
        (`fused`: one launch of `eyas.kernels.rope_store_triton`; otherwise RoPE and `store_rows`). `where`:
        rows=[B, Q] (cache slots), or seq_rows and row_offset (the stash). `norm` (fused only): x is the raw
        residual and `norm` its RMSNorm of unit weight, applied by the same launch (see `attend`). `pdl` (fused
        only): that launch with programmatic dependent launch. Returns the rotated q."""
        q, k, v = self.qkv(x)
        positions = positions.expand(q.shape[:2])
        if fused:
            from eyas.kernels import rope_store_triton
            if norm is not None:
                where = dict(where, norm_x=x, eps=norm.eps)
            return rope_store_triton(positions, q, k, v, rope.cos, rope.sin, k_dst, v_dst, pdl=pdl, **where)
        if norm is not None:
            raise ValueError("a folded input norm is applied by the fused kernels only")
        q, k = rope(positions, q, k)
        store_rows(k_dst, v_dst, k, v, **where)
        return q

    def forward(self, x, positions, rope: RotaryEmbedding, meta: AttentionMetadata | None, cache: KVCache | None,
                fused: bool = False):
        """`fused`: RoPE (and the K/V store it feeds) by the Triton kernels (`DecoderLayer.forward_fused`); the
        reference otherwise. The attention kernels (`meta.use_triton`) return the model's dtype directly."""
        return self.o_proj(self.attend(x, positions, rope, meta, cache, fused))

    def attend(self, x, positions, rope: RotaryEmbedding, meta: AttentionMetadata | None, cache: KVCache | None,
               fused: bool = False, norm: RMSNorm | None = None):
        """`forward` before the output projection: [B, Q, heads * D] in x's dtype.

        `norm` (a model whose norm weights are folded into its projections, `eyas.models.fused.fold_norms`; fused
        only): x is the raw residual stream and `norm` this layer's input RMSNorm, of unit weight. Decode and verify
        steps apply it inside the RoPE + K/V store launch (q, k and v times the row's 1/rms); the other branches
        normalise x first (one launch)."""
        B, Q, _ = x.shape
        if norm is not None and not (meta is not None and (meta.prefix_includes_new or meta.stash is not None)):
            from eyas.kernels import add_rms_norm_triton
            x, norm = add_rms_norm_triton(x, None, norm.weight, norm.eps)[0], None
        if meta is None:  # dense causal attention over the block itself (training, oracles): no cache involved
            q, k, v = self.project(x, positions, rope, fused)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True, scale=self.scale)
            return o.transpose(1, 2).reshape(B, Q, -1)
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        # RoPE + store -> attention -> its reduction; not plain decode steps (see FUSED_PDL)
        pdl = fused and meta.use_triton and not meta.prefix_includes_new and fused_pdl(x.device)
        if meta.prefix_includes_new:  # plain decoding: the token's K/V go to the cache, then one prefix pass
            q = self.rope_store(x, positions, rope, _rows(k_cache), _rows(v_cache), fused, norm, pdl,
                                rows=meta.slot_mapping)
            o = prefix_only_attention(q, k_cache, v_cache, meta, self.scale, out_dtype=x.dtype, pdl=pdl)
        elif meta.stash is not None:  # tree tokens: K/V to the stash (never the cache), suffix over stash rows
            sk, sv = meta.stash.k[self.layer_idx], meta.stash.v[self.layer_idx]  # [B, R, KVH, D]
            q = self.rope_store(x, positions, rope, _rows(sk), _rows(sv), fused, norm, pdl, seq_rows=sk.shape[1],
                                row_offset=meta.stash_at)
            end = meta.stash_at + Q
            o = split_tree_attention(q, sk[:, meta.suffix_from: end], sv[:, meta.suffix_from: end], k_cache,
                                     v_cache, meta, self.scale, out_dtype=x.dtype, pdl=pdl)
        else:  # prefill chunks, the draft's catch-up: attend among themselves, then their K/V go to the cache
            q, k, v = self.project(x, positions, rope, fused)
            o = split_tree_attention(q, k, v, k_cache, v_cache, meta, self.scale, out_dtype=x.dtype, pdl=pdl)
            if meta.slot_mapping is not None:
                self._write_kv(k_cache, v_cache, k, v, meta)
        return o.to(x.dtype).reshape(B, Q, -1)

    @staticmethod
    def _write_kv(k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        if meta.use_triton:
            from eyas.kernels import write_kv_triton
            write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping)
        else:
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., KVH, D] -> [rows, KVH, D], a view: a cache layer's rows are its flat slots, a stash's b * R + node."""
    return t.view(-1, *t.shape[-2:])


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, H, bias=cfg.mlp_bias)

    def fuse_projections(self) -> None:
        """Replace gate/up by one `gate_up_proj` [2I, H] (gate rows first; the originals freed): one GEMM."""
        if hasattr(self, "gate_up_proj"):
            return
        self.gate_up_proj = _concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def gate_up(self, x):
        if hasattr(self, "gate_up_proj"):
            return self.gate_up_proj(x).chunk(2, dim=-1)
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x, fused: bool = False):
        """`fused`: silu(gate) * up by one Triton kernel; the reference otherwise."""
        gate, up = self.gate_up(x)
        if fused:
            from eyas.kernels import swiglu_triton
            return self.down_proj(swiglu_triton(gate, up))
        return self.down_proj(F.silu(gate) * up)

    def add_into(self, x, residual):
        """residual + forward(x, fused=True), accumulated into `residual` in place (`add_linear_`). For the fast
        path's last residual add of an EAGLE draft, which has no final norm; `residual` must be a fresh tensor
        nothing else reads."""
        from eyas.kernels import swiglu_triton
        return add_linear_(residual, swiglu_triton(*self.gate_up(x)), self.down_proj)


def plain_linear(linear: nn.Module) -> bool:
    """A plain nn.Linear without bias or forward (pre-)hooks: one whose output code may compute from its weight
    alone, without running the module (`add_linear_`'s in-GEMM add, the one-row kernels, `fold_norms`). A
    row-parallel projection (tensor parallelism) all-reduces its output in a forward hook, so the module must run;
    an INT4 or FP8 one (eyas.layers.linear_int4, linear_fp8) has no weight of that shape."""
    return (type(linear) is nn.Linear and linear.bias is None and not linear._forward_hooks
            and not linear._forward_pre_hooks)


def add_linear_(residual: torch.Tensor, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """residual += linear(x), in place; one GEMM with cuBLAS's beta = 1 where it can (`plain_linear` and a
    contiguous residual), else the module's output and an add. Returns residual."""
    if not plain_linear(linear) or not residual.is_contiguous():
        return residual.add_(linear(x))
    residual.view(-1, residual.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), linear.weight.t())
    return residual


# The o projection of a wide model's verify pass (O_TILE_MIN_ROWS to O_TILE_ROWS tree or chain tokens in all, hidden
# wider than `eyas.models.one_row.FEW_ROWS_MAX_HIDDEN`, whose verify passes stay on the fused path) on decode_linear's
# tile kernel with the residual add in its epilogue, a PDL launch after the attention's split reduction, instead of
# cuBLAS's split-K GEMM and its reduction kernel. Timed on the H200 in session 44 (tools/device/o_tile_ab.sh: the 8B
# shape's `chain:3`, rank paths replayed, 40 x 128 and 24 x 128, two processes each way; docs/benchmarks.md,
# "Session 44"): a step at batch 2 (8 rows) 5.519-5.521 ms against cuBLAS's 5.661-5.662, at 3 (12 rows) 5.429-5.433
# against 5.472, at 4 (16 rows) 5.459-5.461 against 5.511-5.512; but at batch 1 (4 rows) 5.120-5.123 against
# 5.039-5.041, so 4 rows stay on cuBLAS, and 5 to 7 (unmeasured) with them. O_TILE_ROWS = 0 turns it off.
O_TILE_MIN_ROWS = 8
O_TILE_ROWS = 16
O_TILE_CONFIG = (64, 256, 4, 3)   # decode_linear.TileConfig(BLOCK_N, BLOCK_K, num_warps, num_stages)


def takes_o_tile(residual: torch.Tensor, x: torch.Tensor, linear: nn.Module, meta: AttentionMetadata | None) -> bool:
    """Whether `add_o_proj_` puts this o projection on the tile kernel (see O_TILE_ROWS)."""
    from eyas.models.one_row import FEW_ROWS_MAX_HIDDEN
    H = residual.shape[-1]
    return (bool(O_TILE_ROWS) and meta is not None and meta.use_triton and not meta.prefix_includes_new
            and H > FEW_ROWS_MAX_HIDDEN and O_TILE_MIN_ROWS <= residual.numel() // H <= O_TILE_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and residual.dtype == x.dtype
            and residual.is_contiguous() and plain_linear(linear) and linear.weight.dtype == x.dtype
            and linear.weight.is_contiguous())


def add_o_proj_(residual: torch.Tensor, x: torch.Tensor, linear: nn.Module,
                meta: AttentionMetadata | None) -> torch.Tensor:
    """residual += o_proj(x), in place: on the tile kernel where `takes_o_tile`, else `add_linear_`. Returns
    residual."""
    if not takes_o_tile(residual, x, linear, meta):
        return add_linear_(residual, x, linear)
    from eyas.kernels.decode_linear import TileConfig, decode_linear
    H = residual.shape[-1]
    r2 = residual.view(-1, H)
    decode_linear(x.reshape(r2.shape[0], -1), linear.weight, residual=r2, out=r2, pdl=fused_pdl(x.device),
                  config=TileConfig(*O_TILE_CONFIG))
    return residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, input_norm: bool = True):
        super().__init__()
        # EAGLE drafts have no input norm on their first layer (its input is fc's output).
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, meta, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, hidden, residual, positions, rope, meta, cache, out=None):
        """The same layer on the fused kernels, carrying the residual stream apart (as vLLM does): the layer's input
        is hidden + residual (just `hidden` when residual is None, the first layer), and it returns
        (mlp output, residual), whose sum is what `forward` returns. Each residual add is fused into the RMSNorm
        that follows it (`eyas.kernels.add_rms_norm_triton`). Inference only: no autograd through the kernels.
        `out` (an EAGLE draft's last layer, which no norm follows): return that sum itself, written to `out` (the
        down projection adds into the residual, which the post-attention norm writes to `out` when it is
        contiguous: no add kernel, no copy)."""
        from eyas.kernels import add_rms_norm_triton
        norm = self.input_layernorm
        if isinstance(norm, nn.Identity):  # EAGLE's first layer: no input norm
            residual = hidden if residual is None else residual + hidden
            h = residual
        else:
            h, residual = add_rms_norm_triton(hidden, residual, norm.weight, norm.eps)
        a = self.self_attn(h, positions, rope, meta, cache, fused=True)
        post = self.post_attention_layernorm
        if out is None:
            h, residual = add_rms_norm_triton(a, residual, post.weight, post.eps)
            return self.mlp(h, fused=True), residual
        direct = out.is_contiguous() and out.shape == a.shape and out.dtype == a.dtype
        h, residual = add_rms_norm_triton(a, residual, post.weight, post.eps, res_out=out if direct else None)
        y = self.mlp.add_into(h, residual)
        return y if direct else out.copy_(y)

    def forward_folded(self, residual, positions, rope, meta, cache):
        """The layer on the fused kernels for a model whose norm weights are folded into its projections
        (`eyas.models.fused.fold_norms`): one residual stream, updated in place and returned. The o and down
        projections add into it inside their GEMMs (`add_linear_`; o on the tile kernel where `takes_o_tile`), and
        the norms have no kernels of their own: the RoPE + K/V store launch applies the input norm's 1/rms to q, k
        and v (decode and verify steps; `Attention.attend`), the SwiGLU launch the post-attention norm's to gate
        and up. Two launches a layer fewer than `forward_fused`. `residual` must be a contiguous tensor that nothing
        else reads."""
        from eyas.kernels import swiglu_triton
        attn = self.self_attn
        add_o_proj_(residual, attn.attend(residual, positions, rope, meta, cache, True, self.input_layernorm),
                    attn.o_proj, meta)
        act = swiglu_triton(*self.mlp.gate_up(residual), norm_x=residual, eps=self.post_attention_layernorm.eps)
        return add_linear_(residual, act, self.mlp.down_proj)


def takes_fused_path(model: nn.Module, device: torch.device) -> bool:
    """Whether `model` (fused_ops set) runs the fused kernels now: only with autograd off (the kernels have no
    backward) and outside autocast (whose mixed dtypes the kernels do not take); the eager reference otherwise."""
    return (model.fused_ops and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(device.type))


class RawTaps(tuple):
    """Feature layers read as EAGLE-3 checkpoints were trained to read them (`eyas.models.eagle3`): the residual
    stream after each layer raw (not normalised), and no final hidden state after them. A tuple of layer indices,
    so every reader of `feature_layers` takes it as it takes eyas's own (normalised, final state last)."""


def is_raw(feature_layers) -> bool:
    return isinstance(feature_layers, RawTaps)


def with_features(hidden: torch.Tensor, taps: dict, feature_layers, num_layers: int):
    """What a target forward returns: `hidden`, or (hidden, cat(taps in `feature_layers` order, then hidden));
    `RawTaps`: (hidden, cat(taps) alone)."""
    if feature_layers is None:
        return hidden
    missing = [i for i in feature_layers if i not in taps]
    if missing:
        raise ValueError(f"feature layers {missing} are outside the target's {num_layers} layers")
    return hidden, torch.cat([taps[i] for i in feature_layers] + ([] if is_raw(feature_layers) else [hidden]),
                             dim=-1)


def _concat_linears(*parts: nn.Linear) -> nn.Linear:
    """One nn.Linear whose output is the concatenation of `parts`' outputs (same input)."""
    w = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias for p in parts):
        raise ValueError("cannot fuse projections where only some have a bias")
    out = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device="meta")
    out.weight = nn.Parameter(w, requires_grad=parts[0].weight.requires_grad)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=parts[0].bias.requires_grad)
    return out


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding.for_config(cfg)
        # the fused Triton kernels instead of the eager reference (`eyas.models.fused.use_fused_ops`); they run only
        # with autograd off (`takes_fused_path`), so training always takes the reference path
        self.fused_ops = False
        # batch-1 plain decode steps on eyas.kernels.decode_linear (`eyas.models.one_row`; set by enable_fast_path)
        self.one_row = False
        # verify passes and plain steps of 2 to 64 tokens on its tile kernels (`eyas.models.one_row`; small models)
        self.few_rows = False
        # the decoder layers' norm weights are folded into their projections (`eyas.models.fused.fold_norms`): the
        # fused forward runs `DecoderLayer.forward_folded`
        self.norms_folded = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None = None,
                cache: KVCache | None = None, feature_layers: tuple[int, ...] | None = None):
        """input_ids, positions [B, Q] -> final hidden state [B, Q, H] (after the final norm).

        With `meta` and `cache`: a paged step (prefix in the cache, suffix under `meta.suffix_mask`).
        Without: plain causal attention over the block (training and tests).

        `feature_layers` (EAGLE-3-style drafts, `EagleDraft.read_features`): returns (hidden, features), features
        [B, Q, (k+1)H] = cat(rms(r_i) for i in feature_layers, then hidden), r_i the residual stream after decoder
        layer i (0-based: HF's hidden_states[i + 1]), rms parameter-free (`rms_normalize`, so the layers'
        scales are comparable with each other and with the final hidden state); `RawTaps` (EAGLE-3 checkpoints):
        cat(r_i for i in feature_layers), raw. None: `hidden` alone."""
        x = self.model.embed_tokens(input_ids)
        want = set(feature_layers) if feature_layers is not None else ()
        raw = is_raw(feature_layers)
        eps = self.config.rms_norm_eps
        taps: dict[int, torch.Tensor] = {}  # layer -> rms(r_i)
        if takes_fused_path(self, x.device):
            from eyas.models.one_row import forward_rows, takes_few_rows, takes_one_row
            if takes_one_row(self, x, meta) or takes_few_rows(self, x, meta):  # eyas.models.one_row
                return forward_rows(self, x, positions, meta, cache, feature_layers)
            from eyas.kernels import add_rms_norm_triton
            res = None
            for i, layer in enumerate(self.model.layers):
                if self.norms_folded:  # x is the residual stream (the embedding's output, a fresh tensor at first)
                    x = layer.forward_folded(x, positions, self.rope, meta, cache)
                else:
                    x, res = layer.forward_fused(x, res, positions, self.rope, meta, cache)
                if i in want and raw:  # r_i = x + res (folded layers carry r_i in x alone)
                    taps[i] = x.clone() if res is None else x + res
                elif i in want:  # with a unit weight the fused norm is rms(r_i) in one launch
                    taps[i] = add_rms_norm_triton(x, res, self._unit_weight(x), eps)[0]
            hidden = add_rms_norm_triton(x, res, self.model.norm.weight, self.model.norm.eps)[0]
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, positions, self.rope, meta, cache)
                if i in want:
                    taps[i] = x if raw else rms_normalize(x, eps)
            hidden = self.model.norm(x)
        return with_features(hidden, taps, feature_layers, len(self.model.layers))

    def _unit_weight(self, x: torch.Tensor) -> torch.Tensor:
        """Ones [H] in x's dtype and device, made once (an RMSNorm weight that makes the norm `rms_normalize`: the
        normalised value cast to x's dtype, times exactly 1)."""
        w = getattr(self, "_ones", None)
        if w is None or w.dtype != x.dtype or w.device != x.device:
            w = self._ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        return w

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Logits in `dtype` (None: the head's own, e.g. for a top-k, which needs no upcast: one kernel fewer)."""
        # as one 2-D matmul: a strided 3-D input sends F.linear to a batched matmul that re-reads the whole head
        # per row (measured on the H200: 7.8 ms instead of ~0.3 ms for a 128k vocabulary)
        H = hidden.shape[-1]
        if self.one_row and hidden.numel() == H and takes_fused_path(self, hidden.device):
            from eyas.models.one_row import logits_one_row
            logits = logits_one_row(self, hidden)
        else:
            logits = self.lm_head(hidden.reshape(-1, H))
        return (logits if dtype is None else logits.to(dtype)).view(*hidden.shape[:-1], -1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)
