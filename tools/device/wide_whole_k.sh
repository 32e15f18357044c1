# Session 37: can the whole-K tile take the default tree's 49-row verify pass faster than cuBLAS? One call, no
# staging: (1) tile_chain_bench's per-kind sweep at 49 rows (SmolLM2's shapes), (2) the engine (smollm2-shape, run N
# A's bf16 rank paths replayed, the default tree at batch 1, 8 x 64) with FEW_ROWS_MAX = 64 and each kind's best
# config from (1) for launches of more than 16 rows (SwiGLU's pairs: gate/up's best; RoPE's (fewer than 1024 pairs):
# qkv_rope's; K = 1536: down's; else o's), alternated with main (49 rows on cuBLAS).
# Session 37's run (call 5) had no qkv_rope kind and gave RoPE gate/up's 64-pair tiles (480 pairs: 30 programs); the
# tree's step was no shorter (1.166-1.178 ms against 1.137-1.163). The qkv_rope kind was added after it.
# Since session 38 main's defaults are that rule (WHOLE_K_ROWS = FEW_ROWS_MAX = 64): "wide" is each kind's best of
# this run's sweep against them.
#   bash tools/device/wide_whole_k.sh          (CONFIGS: the sweep's list; ORDER the processes)
set -u
source tools/device/ab_lib.sh
begin wide_whole_k
echo "== sweep [t=$(el)]"
timeout 300 python3 tools/diag/tile_chain_bench.py --shape smollm2 --rows 49 --per-kind --out $OUT/sweep.json \
  --configs ${CONFIGS:-32x0x4x1x32,64x0x4x1x16,64x0x8x1x16,64x0x8x1x32,64x0x4x1x32,128x0x8x1x16,32x0x2x1x16,32x0x4x1x16,16x0x4x1x32,16x0x2x1x32,16x0x8x1x32,32x0x8x1x16,16x0x4x1x16,16x128x4x3x32,16x64x4x4x16,32x128x8x3x16,16x256x8x2x16,16x128x2x3x16,64x64x4x3x16,32x256x4x2x16,16x256x4x3x16,16x256x4x4x0x1,16x128x4x4x16x1,16x128x4x3x32x1} \
  2>&1 | grep -v Warning | grep "'kind'\|variant" | cut -c1-400
SET="import json, eyas.models.one_row as o, eyas.kernels.decode_linear as dl
o.FEW_ROWS_MAX = 64
best = {r['kind']: r['best'] for r in json.load(open('$OUT/sweep.json'))['per_kind']}
def cfg(name):
    return dl.TileConfig(*(int(v) for v in name.split('x')))
base = dl.default_tile_config
def wide(M, N, K, pairs=False, elem_bytes=2):
    if M <= 16 or elem_bytes != 2:
        return base(M, N, K, pairs, elem_bytes)
    if pairs:
        return cfg(best['gu'] if N >= 1024 else best.get('qkv_rope', best['gu']))
    return cfg(best['down'] if K > 1024 else best['o'])
dl.default_tile_config = wide
print('wide configs', best, flush=True)"
main_vs wide "$SET" bench latency --model smollm2-shape --context 128 \
  --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors --batch-sizes 1 --num-prompts 8 \
  --max-tokens 64 --modes tree:smollm2_48d5
grep -h "wide configs" $OUT/wide_*.log | head -n 1
echo "== rows [t=$(el)]"
latency_rows
