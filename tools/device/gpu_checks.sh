#!/usr/bin/env bash
# Call 1 of tools/device/README.md, on the GPU machine, after `cp .stage/a/part_aa ...`: the GPU-only kernel tests,
# the GEMV microbenchmark and the 8B-shape latency rows (random weights; they need no model), each under a timeout
# so that the call ends in time. Results land in $OUT.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used,clocks.max.sm --format=csv,noheader
echo "== GPU kernel tests [t=$(el)]"
# ~140 s of these are Triton compiles for tests/test_kernels.py alone (H200, 2026-11-29); the graphs tests of the
# feature-layer and draft-vocabulary drafts need no model (the SmolLM2 one skips until call 2 stages it)
timeout ${TESTS_S:-330} python3 -m pytest -q ${TESTS:-tests/test_kernels.py tests/test_gemv.py tests/test_fused_ops.py \
  tests/test_cuda_graph.py} -p no:cacheprovider 2>&1 | tail -n 8
echo "== GEMV bench [t=$(el)]"
[ -f tools/diag/gemv_bench.py ] && timeout ${GEMV_S:-150} python3 tools/diag/gemv_bench.py --out $OUT/gemv.json 2>&1 | tail -n 60
# RANKS: a rank-path recording (`eyas make-tree --save-eval-ranks`) replayed exactly for any tree; else RATES
ACCEPT=$([ -n "${RANKS:-}" ] && echo "--accept-ranks $RANKS" || echo "--accept-rates ${RATES:-0.6,0.45,0.4}")
echo "== 8B shape latency [t=$(el)]"
timeout ${LAT_S:-200} python3 -m eyas.cli bench latency --model ${MODEL:-llama-3.1-8b-shape} --modes ${MODES:-plain,chain:3,tree:8} \
  --batch-sizes ${BATCHES:-1,32} --context ${CONTEXT:-1024} --max-tokens ${NEW:-64} $ACCEPT \
  --out $OUT/l8b ${PROFILE:---profile} > $OUT/l8b.log 2>&1; cat $OUT/l8b/*.md   # the profiles: l8b.log
if [ -n "${DRAFT_VOCAB:-}" ]; then  # the same speculative rows with a reduced draft vocabulary of DRAFT_VOCAB tokens
  echo "== 8B shape latency, draft vocabulary $DRAFT_VOCAB [t=$(el)]"
  timeout ${LAT_DV_S:-150} python3 -m eyas.cli bench latency --model ${MODEL:-llama-3.1-8b-shape} \
    --modes ${MODES_DV:-chain:3,tree:8} --batch-sizes ${BATCHES:-1,32} --context ${CONTEXT:-1024} \
    --max-tokens ${NEW:-64} $ACCEPT --draft-vocab $DRAFT_VOCAB --out $OUT/l8bdv \
    > $OUT/l8bdv.log 2>&1; cat $OUT/l8bdv/*.md
fi
(cd $OUT && tar czf l8b.tar.gz l8b* && rm -rf l8b l8bdv l8b.log l8bdv.log)  # at most 8 files come back
echo "== end [t=$(el)]"
