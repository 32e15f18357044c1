#!/usr/bin/env bash
# Issue #4 (and #5, point 2a), session 27: does a wider draft MLP raise TPC? Where SmolLM2's draft steps are bound by
# kernel launches, width costs the draft little time, depth a launch chain. The shipped draft (run N A) continued two
# ways on the same regenerated data, side by side on one H200: A widened to --draft-intermediate ${WIDE:-6144}
# (`init_from_checkpoint`: the added units silent at first), B (control) as it is.
# The GGUF comes in three parts (the working tree, 17 MB, plus one half of it is over a call's 64 MiB):
#   call 1: carry .stage/a   command: mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
#   call 2: carry .stage/b   command: cp .stage/b/part_ab /root/stage/
#   call 3: carry .stage/c   command: STAGE=1 bash tools/device/wide_ab.sh
#   call 4 (back to back):  command: STAGE=2 bash tools/device/wide_ab.sh
# .stage/c: part_ac, the gguf wheel, MT-Bench's question.jsonl, sg_first.jsonl.gz (first user turns of ShareGPT shards
# 00-03, tools/device/first_turns.py) and ctx_prompts.jsonl.xz (`eyas make-context-prompts --num 12000 --seed 27`
# on shards 00-01 with tools/device/context_templates.txt).
# STAGE=1: joins and checks the GGUF; SmolLM2 answers both prompt sets greedily (at most 160 tokens); the shipped
#   draft's MT-Bench TPC; then ab_train.sh starts detached (STEPS 2000, TB 300 s). (Session 27 ran the TPC beside the
#   answering, as ctx_ab.sh does: its engine held 84 GB and the ShareGPT answering, at batch 256 with prompts of up to
#   1,024 tokens, ran out of memory asking for 40 GB; its answers were made in the next call, by hand. Now in turn.)
# A CPU dry run: STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o DEV="--device cpu" LIMIT=6 SG_S=20 CTX_S=20 TPC0_S=5 WIDE=2304 \
#   STEPS=3 TB=60 TPC_S=1 EXTRA="--limit 20 --batch-tokens 2048 --device cpu" bash tools/device/wide_ab.sh (STAGE=1, then 2)
# STAGE=2: waits for it, returns its files (tpc.json, the drafts' tar parts), then times batch-1 decoding of real
#   SmolLM2 on 40 MT-Bench prompts with the shipped draft and with A (plain, chain:3, the default tree; not run in
#   session 27, whose device time had run out). The wait's pattern, "[a]b_train.sh", cannot match its own command
#   line: session 27 waited inline with `while pgrep -f ab_train.sh`, which found the call's own shell and spun to
#   the call's timeout (about 9 device minutes lost).
set -u
export OUT
source tools/device/thirds_lib.sh
case ${STAGE:-1} in
1)
  stage_thirds || exit 1
  answer sg sg_first.jsonl.gz ${SG_S:-80}
  answer ctx ctx_prompts.jsonl.xz ${CTX_S:-90}
  echo "== tpc of the shipped draft [t=$(el)]"
  timeout ${TPC0_S:-240} python3 -m eyas.bench.tpc --model smollm2 --draft default --speculation chain:3 \
    --speculation tree:smollm2_48d5 --temperature 0 --max-tokens 128 --prompts $S/question.jsonl \
    ${DEV:-} --out $W/tpc0 2>&1 | grep "^|"; cp $W/tpc0/tpc.json $OUT/tpc0.json 2>/dev/null
  mkdir -p $W/abo
  (OUT=$W/abo A_DATA="$W/sg.jsonl.xz $W/ctx.jsonl.xz" B_DATA="$W/sg.jsonl.xz $W/ctx.jsonl.xz" \
    BASE_ARGS="--layers 1 --unroll 3 --init eyas/drafts/smollm2 --feature-layers 3 15 --lr 3e-4 --w-ce 1.0 --w-l1 0.1" \
    A_ARGS="--answer-tokens 128 --draft-intermediate ${WIDE:-6144}" B_ARGS="--answer-tokens 128" \
    STEPS=${STEPS:-2000} TB=${TB:-300} TPC_S=${TPC_S:-200} PART_SIZE=15M TPC_EXTRA="${DEV:-}" \
    setsid nohup bash tools/device/ab_train.sh > $W/ab.log 2>&1 < /dev/null &)
  sleep 30; tail -n 3 $W/a.log $W/b.log; echo "== end [t=$(el)]" ;;
2)
  while pgrep -f "[a]b_train.sh" > /dev/null; do sleep 5; done
  cat $W/ab.log; cp $W/abo/* $OUT/
  source tools/device/stage_smollm2.sh > /dev/null 2>&1
  for d in default $W/a; do
    n=$([ $d = default ] && echo shipped || echo wide)
    echo "== latency, $n draft [t=$(el)]"
    timeout ${LAT_S:-150} python3 -m eyas.cli bench latency --model smollm2 --draft $d --modes plain,chain:3,tree:smollm2_48d5 \
      --batch-sizes 1 --num-prompts 40 --max-tokens 128 --prompts $S/question.jsonl ${DEV:-} --out $W/lat_$n 2>&1 | grep "^|"
    cp $W/lat_$n/latency.json $OUT/latency_$n.json 2>/dev/null
  done
  ls -la $OUT; echo "== end [t=$(el)]" ;;
esac
