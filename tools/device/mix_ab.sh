#!/usr/bin/env bash
# Issue #4, for the session after 27: does tools/device/openings3.txt (openings that lead to writing, role-play and
# humanities prose, where the shipped draft is weakest) pay, on top of every kind of data the shipped draft was
# trained on? Runs after run N trained on a single kind lost on the others (run O, docs/draft-training.md), so both
# variants here get all the kinds again: the shipped draft continued 2,000 steps on
#   A: opening-led prompts (openings.txt + openings2.txt, seed 5, as run M) + openings3 prompts (seed 28) + ShareGPT
#      first turns + passage tasks, all answered by SmolLM2 greedily (at most 160 tokens);
#   B (control): the same without the openings3 prompts.
# The GGUF in thirds, as wide_ab.sh (its header: .stage/a, .stage/b, .stage/c; .stage/c also holds sg_first.jsonl.gz
# and ctx_prompts.jsonl.xz, made on the CPU as its header says):
#   call 1: carry .stage/a   command: mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
#   call 2: carry .stage/b   command: cp .stage/b/part_ab /root/stage/
#   call 3: carry .stage/c   command: STAGE=1 bash tools/device/mix_ab.sh   (~8 min: the data, which comes back)
#   call 4 (back to back):  command: STAGE=2 bash tools/device/mix_ab.sh   (training starts detached)
#   call 5 (back to back):  command: STAGE=3 bash tools/device/mix_ab.sh   (waits; MT-Bench TPC of both; the drafts)
# Env: the budgets P_S (50 s a prompt set), R_S (70 s a prompt set's answers), SG_S (60), CTX_S (60); STEPS (2000),
# TB (300). A CPU dry run (STAGE=1, 2, then 3):
#   STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o DEV="--device cpu" NUM=8 P_BATCH=8 R_BATCH=8 LIMIT=6 P_S=20 R_S=20 SG_S=20 \
#     CTX_S=20 MAX_TOK=16 STEPS=3 TB=60 TPC_S=1 EXTRA="--limit 20 --batch-tokens 2048 --device cpu" \
#     bash tools/device/mix_ab.sh
set -u
export OUT
source tools/device/thirds_lib.sh
case ${STAGE:-1} in
1)
  stage_thirds || exit 1
  grep -hv '^#' tools/device/openings.txt tools/device/openings2.txt | grep . > $W/openings12.txt
  for x in 12:$W/openings12.txt:5 3:tools/device/openings3.txt:28; do
    name=${x%%:*}; rest=${x#*:}; file=${rest%:*}; seed=${rest##*:}
    OPENINGS=$file SEED=$seed P_S=${P_S:-50} R_S=${R_S:-70} bash tools/device/starts_data.sh | grep -v "^-"
    mv $W/starts.jsonl.xz $W/starts$name.jsonl.xz; rm -f $OUT/starts.jsonl.xz
  done
  answer sg sg_first.jsonl.gz ${SG_S:-60}
  answer ctx ctx_prompts.jsonl.xz ${CTX_S:-60}
  cp $W/starts12.jsonl.xz $W/starts3.jsonl.xz $W/sg.jsonl.xz $W/ctx.jsonl.xz $OUT/; ls -la $OUT; echo "== end [t=$(el)]" ;;
2)
  mkdir -p $W/abo   # (ab_train.sh stages SmolLM2 itself)
  ALL="$W/starts12.jsonl.xz $W/sg.jsonl.xz $W/ctx.jsonl.xz"
  (OUT=$W/abo A_DATA="$ALL $W/starts3.jsonl.xz" B_DATA="$ALL" A_ARGS="--answer-tokens 128" B_ARGS="--answer-tokens 128" \
    BASE_ARGS="--layers 1 --unroll 3 --init eyas/drafts/smollm2 --feature-layers 3 15 --lr 3e-4 --w-ce 1.0 --w-l1 0.1" \
    STEPS=${STEPS:-2000} TB=${TB:-300} TPC_S=${TPC_S:-200} TPC_EXTRA="${DEV:-}" \
    setsid nohup bash tools/device/ab_train.sh > $W/ab.log 2>&1 < /dev/null &)
  sleep 30; tail -n 2 $W/a.log $W/b.log; echo "== end [t=$(el)]" ;;
3)
  while pgrep -f "[a]b_train.sh" > /dev/null; do sleep 5; done   # (a pattern that cannot match this command)
  cat $W/ab.log; cp $W/abo/* $OUT/; ls -la $OUT; echo "== end [t=$(el)]" ;;
esac
