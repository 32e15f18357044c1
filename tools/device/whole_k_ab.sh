# Session 37: the whole-K tile (decode_linear's `TileConfig.BLOCK_K = 0`: a program's weight rows loaded before its
# PDL wait, no K loop, blocks of rows) as the default for launches of 2-16 rows (WHOLE_K_ROWS = 16: draft levels,
# `chain:3`'s verify pass), and for the 49-row verify pass of the default tree too (WHOLE_K_ROWS = 64 with
# FEW_ROWS_MAX = 64), against main's tiles and cuBLAS. One call, no staging (smollm2-shape, run N A's bf16 rank
# paths replayed):
#   bash tools/device/whole_k_ab.sh            (TESTS=0 skips the GPU tests; ORDER the processes)
set -u
source tools/device/ab_lib.sh
begin whole_k
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests [t=$(el)]"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k "gpu and (bf16_shapes or stash or few_rows)" 2>&1 | tail -n 4
fi
AB() {  # tag, WHOLE_K_ROWS, FEW_ROWS_MAX, bench latency arguments...
  local tag=$1 wk=$2 few=$3; shift 3
  switch_run $tag eyas.kernels.decode_linear "m.WHOLE_K_ROWS = $wk; import eyas.models.one_row as o; o.FEW_ROWS_MAX = $few" \
    bench latency --model smollm2-shape --context 128 --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors \
    "$@"
}
for v in ${ORDER:-main wk16 wk64 wk64 wk16 main}; do
  echo "== $v [t=$(el)]"
  case $v in main) a="0 16";; wk16) a="16 16";; wk64) a="64 64";; esac
  AB ${v}_$(el) $a --batch-sizes 1 --num-prompts 8 --max-tokens 64 --modes chain:3,tree:smollm2_48d5
done
echo "== rows [t=$(el)]"
latency_rows
