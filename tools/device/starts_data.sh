#!/usr/bin/env bash
# Issue #4 after run J: many more distinct answer starts. SmolLM2 writes new prompts itself (eyas make-prompts, with
# a seed other than run F's 0) and answers them greedily, at most MAX_TOK (160) tokens each (the MT-Bench TPC judges
# 128), through the shipped draft. The result, $W/starts.jsonl.xz (also in $OUT), feeds an A/B of ab_train.sh:
#   A_DATA="$D $W/starts.jsonl.xz" A_ARGS="--answer-tokens 128" B_ARGS="--answer-tokens 128" bash tools/device/ab_train.sh
# OPENINGS=tools/device/openings.txt steers the prompts towards eight kinds of task (eyas make-prompts --openings).
# Call 2 or later of tools/device/README.md (GGUF's first half in /root/stage). A CPU dry run:
#   STAGED=1 OUT=/tmp/o W=/tmp/w NUM=8 P_BATCH=8 R_BATCH=8 P_S=20 R_S=30 MAX_TOK=16 DEV="--device cpu" \
#     bash tools/device/starts_data.sh   (small batches: at 512 the CPU runs for minutes before the budget is checked)
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
source tools/device/stage_smollm2.sh > /dev/null 2>&1
[ -n "${STAGED:-}" ] || [ -f $S/smollm2.gguf ] || { echo "staging failed"; exit 1; }
echo "== make-prompts: at most ${NUM:-40000}, ${P_S:-120} s, seed ${SEED:-1} [t=$(el)]"
python3 -m eyas.train.self_instruct --model smollm2 --num ${NUM:-40000} --out $W/starts_prompts.jsonl.gz \
  --batch-size ${P_BATCH:-512} --time-budget ${P_S:-120} --seed ${SEED:-1} --no-progress ${DEV:-} \
  ${OPENINGS:+--openings $OPENINGS} 2>&1 | tail -n 3
echo "== answer them: at most ${MAX_TOK:-160} tokens, ${R_S:-180} s [t=$(el)]"
python3 -m eyas.train.distill_data --model smollm2 --data $W/starts_prompts.jsonl.gz --out $W/starts.jsonl.xz \
  --max-tokens ${MAX_TOK:-160} --batch-size ${R_BATCH:-256} --max-turns 1 --max-prompt-tokens 1024 \
  --time-budget ${R_S:-180} --draft default --speculation chain:3 --no-progress ${DEV:-} 2>&1 | tail -n 3
cp $W/starts.jsonl.xz $OUT/ && ls -la $OUT/starts.jsonl.xz
echo "== end [t=$(el)]"
