#!/usr/bin/env bash
# Issue #5 point 3 with FP8 drafts (session 13; no SmolLM2 needed): the compiled FP8 GEMV against its reference,
# cuBLAS bf16 against it on an 8B draft level's shapes, then the 8B-shape rows with a 32k draft vocabulary, bf16 and
# FP8 drafts side by side in one call (they share the machine's state). Everything lands in $OUT.
#   bash tools/device/fp8_checks.sh                  # on the GPU machine, from the repository root
# RANKS / RANKS_FP8: the rank paths replayed for the bf16 and the FP8 draft (SmolLM2 + run L, CPU float32, each with
# its draft vocabulary); NP: prompts per row; SKIP_TESTS=1 / SKIP_BENCH=1 skip the first two parts.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RANKS=${RANKS:-docs/bench/ranks_smollm2_runL_dv32k_cpu.safetensors}
RANKS_FP8=${RANKS_FP8:-$RANKS}
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== FP8 GPU tests [t=$(el)]"
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_gemv.py -k "gpu or llama8b \
or cuda_graph" 2>&1 | tail -n 6
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== gemv_fp8_bench [t=$(el)]"
  timeout ${BENCH_S:-240} python3 tools/diag/gemv_fp8_bench.py --out $OUT/fp8_gemv.json 2>&1 | grep -v "^    Gemv"
fi
L="python3 -m eyas.cli bench latency --model llama-3.1-8b-shape --context 1024 --max-tokens 64 --num-prompts ${NP:-32}"
M=${MODES:-chain:3,tree:smollm2_48d5}
echo "== 8B rows, bf16 draft, --draft-vocab 32768 [t=$(el)]"
timeout 150 $L --modes plain,$M --batch-sizes ${BATCHES:-1,32} --draft-vocab 32768 --accept-ranks $RANKS \
  --out $OUT/l8b_dv_bf16 2>&1 | grep "^|"
echo "== 8B rows, --draft-quant fp8, --draft-vocab 32768 [t=$(el)]"
timeout 150 $L --modes $M --batch-sizes ${BATCHES:-1,32} --draft-vocab 32768 --draft-quant fp8 \
  --accept-ranks $RANKS_FP8 --out $OUT/l8b_dv_fp8 2>&1 | grep "^|"
echo "== end [t=$(el)]"
cd $OUT && tar czf rows.tgz l8b_*/ && rm -rf l8b_*/ ; ls $OUT
