#!/usr/bin/env bash
# Session 5, the step cost of trees on the GPU (after a call that copied .stage/a/part_aa to /root/stage): finishes
# staging SmolLM2 (carry .stage/b and .stage/trees, extra tree JSON files), checks graphs == eager on SmolLM2, then
# `eyas bench latency` at batch 1 over all 80 MT-Bench first turns for plain, the presets and the extra trees (the
# step costs that `eyas make-tree --step-cost` fits), and a profile of three steps. Results: $OUT/tree_costs.tar.gz.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
source tools/device/stage_smollm2.sh
R=$W/tree_costs; mkdir -p $R
if [ -n "${GRAPH_TEST-1}" ]; then  # GRAPH_TEST= (empty) skips it
  echo "== graphs == eager, SmolLM2 [t=$(el)]"
  timeout ${GRAPH_TEST_S:-120} python3 -m pytest -q tests/test_cuda_graph.py -k smollm2 -p no:cacheprovider 2>&1 | tail -n 2
fi
EXTRA=$(ls .stage/trees/*.json 2>/dev/null | tr '\n' ',')
MODES=${MODES:-plain,chain:3,tree:8,tree:16,tree:mc_sim_7b_63,tree:smollm2_25,tree:smollm2_64,tree:smollm2_128,$EXTRA}
echo "== latency, batch ${BATCHES:-1}, ${NP:-80} prompts: $MODES [t=$(el)]"
timeout ${LAT_S:-330} python3 -m eyas.cli bench latency --model smollm2 --draft default --modes ${MODES%,} \
  --batch-sizes ${BATCHES:-1} --num-prompts ${NP:-80} --max-tokens ${NEW:-128} --prompts $S/question.jsonl \
  --out $R/lat 2>&1 | grep -v '^\s*$' | grep -v '%|' | tail -n 24
PROF_MODES=${PROF_MODES-plain,chain:3,tree:mc_sim_7b_63,tree:smollm2_128}  # PROF_MODES= (empty) skips the profile
if [ -n "$PROF_MODES" ]; then
  echo "== profile [t=$(el)]"
  timeout ${PROF_S:-90} python3 -m eyas.cli bench latency --model smollm2 --draft default --modes $PROF_MODES \
    --batch-sizes 1 --num-prompts 1 --max-tokens 32 --prompts $S/question.jsonl --out $R/prof --profile \
    > $R/profile.log 2>&1
  grep -a "^--- profile\|^GPU kernels per step" $R/profile.log
fi
if [ -n "${HF_NP:-}" ]; then  # HF eager in the same call, on HF_NP prompts spread over the categories
  echo "== HF eager, $HF_NP prompts [t=$(el)]"
  timeout $(( ${END_S:-590} - $(el) )) python3 -m eyas.cli bench peers --model smollm2 --prompts $S/question.jsonl \
    --num-prompts $HF_NP --max-tokens ${NEW:-128} --peers hf-eager --out $R/peers 2>&1 | grep -v '^\s*$' | tail -n 2
fi
(cd $W && tar czf $OUT/tree_costs.tar.gz tree_costs)
echo "== end [t=$(el)]"
