#!/usr/bin/env bash
# Issue #4 after session 21 (the data of runs D-L is gone): new opening-led prompts, and the CE term's soft labels
# sharpened towards the target's argmax (`--ce-temperature 0.5`, never trained with before).
# STAGE=1 (a call on a machine where stage_smollm2.sh has run, e.g. after fused_pdl_ab.sh STAGE=2): SmolLM2 writes
#   prompts led by tools/device/openings.txt + openings2.txt (seed $SEED, 5) and answers them greedily (at most 160
#   tokens, starts_data.sh; $OUT/starts.jsonl.xz comes back), then ab_train.sh starts detached: both variants continue
#   the shipped draft on that data with --answer-tokens 128; B adds --ce-temperature 0.5. Then MT-Bench TPC of both.
# STAGE=2 (the next call, back to back): waits for it and returns its files (tpc.json, the drafts' tar parts).
# Env: P_S (110), R_S (170), STEPS (1400), TB (260), SEED (5). A CPU dry run (stage 1 ends with the training
# detached; its MT-Bench rows need $S/question.jsonl, which only the GPU staging copies):
#   STAGED=1 OUT=/tmp/o W=/tmp/w NUM=8 P_BATCH=8 R_BATCH=8 P_S=20 R_S=30 MAX_TOK=16 DEV="--device cpu" \
#     EXTRA="--limit 20 --batch-tokens 2048 --device cpu" STEPS=3 TB=60 bash tools/device/openings2_ab.sh
set -u
export OUT
W=${W:-/root/w}
if [ "${STAGE:-1}" = 1 ]; then
  mkdir -p $W && grep -hv '^#' tools/device/openings.txt tools/device/openings2.txt | grep . > $W/openings_all.txt
  wc -l < $W/openings_all.txt
  OPENINGS=$W/openings_all.txt SEED=${SEED:-5} P_S=${P_S:-110} R_S=${R_S:-170} bash tools/device/starts_data.sh
  mkdir -p $W/abo
  (OUT=$W/abo A_DATA=$W/starts.jsonl.xz B_DATA=$W/starts.jsonl.xz A_ARGS="--answer-tokens 128" \
    B_ARGS="--answer-tokens 128 --ce-temperature 0.5" STEPS=${STEPS:-1400} TB=${TB:-260} TPC_S=150 \
    setsid nohup bash tools/device/ab_train.sh > $W/ab.log 2>&1 < /dev/null &)
  sleep 20; tail -n 3 $W/a.log
else
  while pgrep -f ab_train.sh > /dev/null; do sleep 5; done
  cat $W/ab.log; cp $W/abo/* $OUT/; ls -la $OUT
fi
