#!/usr/bin/env bash
# Issue #5, points 2a and 3 (session 25): an upper bound, not a path. What would the verify passes gain if their
# RoPE + K/V store launch (rope_store_triton into the step's stash) cost nothing, as it would folded into the split
# tree attention? "on" skips that launch (returns q unrotated, stores nothing): wrong numbers, but the rows below
# replay recorded acceptance on random weights, so every other kernel runs as it does for real. The 8B shape's
# chain:3 (ab_lib's L8B) and the smollm2-shape's default tree (run N A's H200 rank paths), batch 1, processes
# alternated. No carry. (Session 25's first run crashed in every "on" process: the stashes were torch.empty.)
# Env: NP (80), MAXT (128), ORDER8 ("1 0"), ORDERS ("1 0 1 0").
set -u
NP=${NP:-80}; MAXT=${MAXT:-128}
source tools/device/ab_lib.sh
begin ropeskip
SKIP="import torch, eyas.kernels as K, eyas.kernels.fused_rope as fr, eyas.layers.attention as A
if on:
    # the stashes that the skipped launch would fill: zeros, allocated once (no kernel in the graphs), so that the
    # attention reads finite values (garbage gave NaN features, the draft's top-k invalid tokens, a crash)
    zs = {}
    def like(cls, cache, batch, rows):
        L, _, _, KVH, D = cache.k.shape
        key = (L, batch, rows, KVH, D, cache.k.dtype, cache.k.device)
        if key not in zs:
            zs[key] = cls(torch.zeros(key[:5], dtype=key[5], device=key[6]),
                          torch.zeros(key[:5], dtype=key[5], device=key[6]))
        return zs[key]
    A.Stash.like = classmethod(like)
    orig = fr.rope_store_triton
    def skip(positions, q, k, v, *a, seq_rows=None, **kw):
        if seq_rows is not None:
            return q
        return orig(positions, q, k, v, *a, seq_rows=seq_rows, **kw)
    K.rope_store_triton = skip"
echo "== smollm2-shape, default tree, stash RoPE skipped or not [t=$(el)]"
ORDER=${ORDERS:-1 0 1 0} alternate skip "$SKIP" "^| [pt]" $R/sm bench latency --model smollm2-shape --context 128 \
  --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors --batch-sizes 1 --num-prompts $NP \
  --max-tokens $MAXT --modes plain,tree:smollm2_48d5 --repeat 1
echo "== 8B chain:3, stash RoPE skipped or not [t=$(el)]"
ORDER=${ORDER8:-1 0} alternate skip "$SKIP" "^| [pc]" $R/l8b $L8B --batch-sizes 1 --num-prompts $NP \
  --max-tokens $MAXT --modes plain,chain:3 --repeat 1
(cd $R/.. && tar czf $OUT/ropeskip.tar.gz ropeskip)
echo "== end [t=$(el)]"
