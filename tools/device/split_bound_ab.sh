# For the session after 33 (issue #5, servers): the attention's split count chosen for min(table width,
# tree_attention.SPLIT_BOUND_TOKENS) instead of the width. Session 33 found a server's width (SmolLM2's 8192) costing
# the default tree's step 7-9% and plain decoding's 5-8% at a chat's context, most of it idle split programs and
# 64-wide partials; the cap gives a wide table the splits of a shorter context, at the price of more key tiles a
# split for a long context. One call, no staging (smollm2-shape, run N A's bf16 rank paths replayed):
#   bash tools/device/split_bound_ab.sh     (BENCH=0 skips the kernels alone; BOUNDS="none 2048" the values
#                                            alternated; CONTEXTS="128 3072" the prompt lengths; ROUNDS=2)
set -u
source tools/device/ab_lib.sh
begin split_bound   # eyas on the path, $OUT made, the clock (el)
if [ "${BENCH:-1}" = 1 ]; then
  echo "== kernels alone [t=$(el)]"
  timeout 150 python3 tools/diag/empty_splits_bench.py --widths 8256 --contexts 150,1500,7000 --variants rule \
    --bounds 1024,2048 --out $OUT/kernels.json 2>&1 | tail -n 8
fi
for r in $(seq ${ROUNDS:-2}); do
  echo "== engine A/B round $r [t=$(el)]"
  for ctx in ${CONTEXTS:-128 3072}; do
    for b in ${BOUNDS:-none 2048}; do
      v=$([ $b = none ] && echo None || echo $b)
      switch_run b${b}_c${ctx}_$r eyas.kernels.tree_attention "m.SPLIT_BOUND_TOKENS = $v" bench latency \
        --model smollm2-shape --context $ctx --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors \
        --batch-sizes 1 --num-prompts 8 --max-tokens 64 --modes plain,tree:smollm2_48d5 --max-model-len 8192
    done
  done
done
echo "== rows [t=$(el)]"
latency_rows
