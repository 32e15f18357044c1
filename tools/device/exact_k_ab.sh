# Session 31: the register kernel holding K as two power-of-two parts (decode_linear.EXACT_K; SmolLM2's K = 576 as
# 512 + 64 instead of one part padded to 1024), against one padded part. One call, no staging (smollm2-shape, run
# N A's bf16 rank paths replayed):
#   bash tools/device/exact_k_ab.sh            (TESTS=0 skips the GPU tests; ROUNDS=2 A/B rounds)
set -u
source tools/device/ab_lib.sh
begin exact_k   # eyas on the path, $OUT made, the clock (el)
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests [t=$(el)]"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k "gpu or k_parts" 2>&1 | tail -n 4
fi
if [ "${KPAD:-1}" = 1 ]; then
  echo "== kpad bench [t=$(el)]"
  timeout 200 python3 tools/diag/kpad_gemv_bench.py --kinds ${KINDS:-head,qkv,o,gu,down} --configs ${CONFIGS:-4x4,8x4,8x8,16x4,16x8,32x8,32x16} \
    --out $OUT/kpad.json 2>&1 | tail -n 6
fi
AB() {  # tag, EXACT_K, bench latency arguments...
  local tag=$1 on=$2; shift 2
  switch_run $tag eyas.kernels.decode_linear "m.EXACT_K = $on" bench latency --model smollm2-shape --context 128 \
    --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors "$@"
}
for r in $(seq ${ROUNDS:-2}); do
  echo "== engine A/B round $r [t=$(el)]"
  for v in ${ORDER:-exact pad}; do
    AB ${v}_b1_$r $([ $v = exact ] && echo True || echo False) --batch-sizes 1 --num-prompts 8 --max-tokens 64 \
      --modes plain,chain:3,tree:smollm2_48d5
  done
done
if [ "${FP8:-1}" = 1 ]; then  # the step's cost with an FP8 draft (its TPC on the real model is another question)
  echo "== fp8 draft [t=$(el)]"
  AB fp8_b1 True --batch-sizes 1 --num-prompts 8 --max-tokens 64 --modes chain:3,tree:smollm2_48d5 --draft-quant fp8
fi
echo "== rows [t=$(el)]"
latency_rows
