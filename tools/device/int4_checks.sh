#!/usr/bin/env bash
# Issue #5 point 3 with INT4 drafts (session 12, call 1; no SmolLM2 needed): the CUDA INT4 kernels against their
# reference, cuBLAS bf16 against both INT4 GEMVs, then the 8B-shape rows with and without an INT4 draft in one call,
# so that they share the machine's state. Everything lands in $OUT (JSON, markdown, plots, logs).
#   bash tools/device/int4_checks.sh                  # on the GPU machine, from the repository root
# RANKS / RANKS_INT4: the rank paths replayed for the bf16 and the INT4 draft (recorded with SmolLM2 and run K's draft).
# KERNELS: which INT4 kernels the 8B rows try (torch = PyTorch's tinygemm, triton = eyas.kernels.gemv_int4); QUANTS:
# which --draft-quant modes; SKIP_TESTS=1 runs the 8B rows only (session 12's call 5, at run L's rank paths).
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RANKS=${RANKS:-docs/bench/ranks_smollm2_runK_mtbench.safetensors}
RANKS_INT4=${RANKS_INT4:-docs/bench/ranks_smollm2_runK_int4_cpu.safetensors}
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== INT4 GPU tests [t=$(el)]"
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_int4.py -k gpu 2>&1 | tail -n 6
  echo "== gemv_int4_bench [t=$(el)]"
  timeout ${GEMV_S:-200} python3 tools/diag/gemv_int4_bench.py --out $OUT/int4_gemv.json 2>&1 | grep -v "^    triton"
fi
L="python3 -m eyas.cli bench latency --model llama-3.1-8b-shape --context 1024 --max-tokens 64 --num-prompts 32"
echo "== 8B rows, bf16 draft [t=$(el)]"
timeout 120 $L --modes plain,chain:3,tree:smollm2_48d5 --batch-sizes ${BATCHES:-1,32} --accept-ranks $RANKS \
  --out $OUT/l8b_bf16 2>&1 | grep "^|"
for k in ${KERNELS:-torch triton}; do
  for q in ${QUANTS:-int4}; do
    echo "== 8B rows, --draft-quant $q --int4-kernel $k [t=$(el)]"
    timeout 120 $L --modes chain:3,tree:smollm2_48d5 --batch-sizes ${BATCHES:-1,32} --accept-ranks $RANKS_INT4 \
      --draft-quant $q --int4-kernel $k --out $OUT/l8b_${q}_$k 2>&1 | grep "^|"
  done
done
echo "== end [t=$(el)]"
