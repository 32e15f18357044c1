#!/usr/bin/env bash
# SmolLM2 with an INT4 draft on the GPU (session 12): graphs == eager with an INT4 draft, its MT-Bench TPC at T=0
# (`eyas bench tpc --draft-quant`), and, with LAT=1, batch-1 latency over the 80 prompts with and without it.
# Call 2 or later of tools/device/README.md (GGUF's first half in /root/stage). Results in $OUT.
#   QUANT=int4 KERNEL=torch LAT=1 bash tools/device/int4_smollm2.sh
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
source tools/device/stage_smollm2.sh > /dev/null 2>&1
[ -n "${STAGED:-}" ] || [ -f $S/smollm2.gguf ] || { echo "staging failed"; exit 1; }
Q=${QUANT:-int4}
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== graphs with an INT4 draft [t=$(el)]"
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k int4 2>&1 | tail -n 4
fi
if [ -z "${SKIP_TPC:-}" ]; then
  echo "== tpc, --draft-quant $Q [t=$(el)]"
  timeout ${TPC_S:-150} python3 -m eyas.bench.tpc --model smollm2 --draft default --draft-quant $Q \
    --speculation chain:3 --speculation tree:smollm2_48d5 --temperature ${TEMPS:-0} --max-tokens 128 \
    --prompts $S/question.jsonl --out $OUT/tpc_$Q 2>&1 | grep "^|"
fi
if [ -n "${LAT:-}" ]; then
  LB="python3 -m eyas.cli bench latency --model smollm2 --draft default --batch-sizes 1 --num-prompts 80 \
    --max-tokens 128 --prompts $S/question.jsonl"
  echo "== SmolLM2 batch 1, bf16 draft [t=$(el)]"
  timeout 150 $LB --modes plain,chain:3,tree:smollm2_48d5 --out $OUT/smollm2_bf16 2>&1 | grep "^|"
  echo "== SmolLM2 batch 1, --draft-quant $Q --int4-kernel ${KERNEL:-torch} [t=$(el)]"
  timeout 150 $LB --modes chain:3,tree:smollm2_48d5 --draft-quant $Q --int4-kernel ${KERNEL:-torch} \
    --out $OUT/smollm2_$Q 2>&1 | grep "^|"
fi
echo "== end [t=$(el)]"
