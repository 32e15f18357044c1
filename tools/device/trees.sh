#!/usr/bin/env bash
# Session 5, call 2 (after gpu_checks.sh in call 1 copied .stage/a/part_aa to /root/stage): the fitted trees on the
# GPU. Finishes staging SmolLM2 (carry .stage/b and .stage/dv), then on MT-Bench's 80 first turns, 128 new tokens:
#   1. `eyas bench tpc` of the shipped draft on the fitted trees (and the old presets) at T=0 and 1, and of the same
#      draft with a 16k draft vocabulary (.stage/dv/draft_vocab.safetensors, `eyas make-draft-vocab`);
#   2. `eyas bench latency` at batch 1 over all 80 prompts (so the measured ms/token is at the 80-prompt TPC) and at
#      batch 4, with and without the draft vocabulary;
#   3. a profile of 3 decode steps of the largest tree and of chain:3 (where the step's time goes);
#   4. HF eager on 8 prompts spread over the categories.
# Results land in $OUT (at most 8 files come back: everything is tarred into one).
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
source tools/device/stage_smollm2.sh
R=$W/trees_s5; mkdir -p $R
DV=$W/dv; mkdir -p $DV && cp eyas/drafts/smollm2/* $DV/ && cp .stage/dv/draft_vocab.safetensors $DV/
SPECS=${SPECS:-chain:3 tree:16 tree:mc_sim_7b_63 tree:smollm2_25 tree:smollm2_64 tree:smollm2_128}
NP=${NP:-80}; NEW=${NEW:-128}
echo "== tpc, shipped draft [t=$(el)]"
timeout ${TPC_S:-200} python3 -m eyas.bench.tpc --model smollm2 --draft default $(for x in $SPECS; do echo --speculation $x; done) \
  --temperature 0 1 --max-tokens $NEW --limit $NP --prompts $S/question.jsonl --out $R/tpc 2>&1 | grep -v '^\s*$' | tail -n 16
echo "== tpc, 16k draft vocabulary [t=$(el)]"
timeout ${TPC_DV_S:-90} python3 -m eyas.bench.tpc --model smollm2 --draft $DV --speculation chain:3 \
  --speculation tree:smollm2_64 --speculation tree:smollm2_128 --temperature 0 --max-tokens $NEW --limit $NP \
  --prompts $S/question.jsonl --out $R/tpc_dv 2>&1 | grep -v '^\s*$' | tail -n 6
echo "== latency, batch 1 over $NP prompts, batch 4 [t=$(el)]"
MODES=${MODES:-plain,chain:3,tree:16,tree:mc_sim_7b_63,tree:smollm2_25,tree:smollm2_64,tree:smollm2_128}
timeout ${LAT_S:-240} python3 -m eyas.cli bench latency --model smollm2 --draft default --modes $MODES \
  --batch-sizes ${BATCHES:-1,4} --num-prompts $NP --max-tokens $NEW --prompts $S/question.jsonl --out $R/lat \
  2>&1 | grep -v '^\s*$' | tail -n 18
echo "== latency, 16k draft vocabulary [t=$(el)]"
timeout ${LAT_DV_S:-120} python3 -m eyas.cli bench latency --model smollm2 --draft $DV \
  --modes ${MODES_DV:-chain:3,tree:smollm2_64,tree:smollm2_128} --batch-sizes ${BATCHES:-1,4} --num-prompts $NP \
  --max-tokens $NEW --prompts $S/question.jsonl --out $R/lat_dv 2>&1 | grep -v '^\s*$' | tail -n 10
echo "== profile [t=$(el)]"
timeout ${PROF_S:-60} python3 -m eyas.cli bench latency --model smollm2 --draft default \
  --modes plain,chain:3,tree:smollm2_128 --batch-sizes 1 --num-prompts 1 --max-tokens 32 --prompts $S/question.jsonl \
  --out $R/prof --profile > $R/profile.log 2>&1; grep -A 24 "^--- profile" $R/profile.log | cut -c 1-150
echo "== HF eager, 8 prompts [t=$(el)]"
timeout $(( ${END_S:-590} - $(el) )) python3 -m eyas.cli bench peers --model smollm2 --prompts $S/question.jsonl \
  --num-prompts ${HF_NP:-8} --max-tokens $NEW --peers hf-eager --out $R/peers 2>&1 | grep -v '^\s*$' | tail -n 3
(cd $W && tar czf $OUT/trees_s5.tar.gz trees_s5)
echo "== end [t=$(el)]"
