#!/usr/bin/env bash
# Issue #4, session 23: does a new kind of prompt -- a task on a passage (`eyas make-context-prompts` with
# tools/device/context_templates.txt, passages from ShareGPT's assistant turns) -- raise MT-Bench TPC? Run M's draft A
# continued two ways, side by side: A on run M's opening-led data (starts.jsonl.xz) + regenerated ShareGPT first turns
# (shards 02-03) + the answered context prompts; B (control) without the context prompts.
# Data comes in .stage/n23 (ctx_prompts.jsonl.xz, starts.jsonl.xz, sharegpt-train-0[23].jsonl.gz, ma/ = run M A).
# STAGE=0 (carry .stage/n23; any call before STAGE=1 on the same machine): copies it to $S/n23.
# STAGE=1 (carry .stage/b, after a call that ran stage_a): SmolLM2 answers both prompt sets greedily (at most 160
#   tokens; both files come back) while another process measures MT-Bench TPC of the shipped draft and run M A with
#   today's tokenizer; then ab_train.sh starts detached (STEPS 2000, TB 300 s; its own TPC of A and B at the end).
# STAGE=2 (the next call, back to back): waits for it and returns its files (tpc.json, the drafts' tar parts).
# A CPU dry run (all three stages):
#   STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o DEV="--device cpu" R_BATCH=8 CTX_S=20 SG_S=20 MAX_TOK=16 TPC0_S=1 \
#     EXTRA="--limit 20 --batch-tokens 2048 --device cpu" STEPS=3 TB=60 TPC_S=1 bash tools/device/ctx_ab.sh (STAGE=0,1,2)
set -u
export OUT
S=${S:-/root/stage}; W=${W:-/root/w}; D=$S/n23
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
case ${STAGE:-1} in
0)
  mkdir -p $D $OUT && cp -r .stage/n23/. $D/ && ls -la $D | tail -n +2 ;;
1)
  source tools/device/stage_smollm2.sh > /dev/null 2>&1
  [ -n "${STAGED:-}" ] || [ -f $S/smollm2.gguf ] || { echo "staging failed"; exit 1; }
  echo "== tpc: shipped (run L) and run M A, beside the answering (its own process) [t=$(el)]"
  (timeout ${TPC0_S:-240} python3 -m eyas.bench.tpc --model smollm2 --draft default $D/ma --speculation chain:3 \
    --speculation tree:smollm2_48d5 --temperature 0 --max-tokens 128 --prompts $S/question.jsonl ${DEV:-} \
    --out $W/tpc0 > $W/tpc0.log 2>&1) &
  for x in ctx:ctx_prompts.jsonl.xz:${CTX_S:-150} sg:"sharegpt-train-02.jsonl.gz sharegpt-train-03.jsonl.gz":${SG_S:-100}; do
    name=${x%%:*}; rest=${x#*:}; files=${rest%:*}; budget=${rest##*:}
    echo "== answer $name ($files), ${budget} s [t=$(el)]"
    python3 -m eyas.train.distill_data --model smollm2 --data $(for f in $files; do echo $D/$f; done) \
      --out $W/$name.jsonl.xz --max-tokens ${MAX_TOK:-160} --batch-size ${R_BATCH:-256} --max-turns 1 \
      --max-prompt-tokens 1024 --time-budget $budget --draft default --speculation chain:3 --no-progress ${DEV:-} \
      2>&1 | tail -n 2
    cp $W/$name.jsonl.xz $OUT/
  done
  wait; grep "^|" $W/tpc0.log; cp $W/tpc0/tpc.json $OUT/tpc0.json 2>/dev/null
  mkdir -p $W/abo
  (OUT=$W/abo A_DATA="$D/starts.jsonl.xz $W/sg.jsonl.xz $W/ctx.jsonl.xz" B_DATA="$D/starts.jsonl.xz $W/sg.jsonl.xz" \
    BASE_ARGS="--layers 1 --unroll 3 --init $D/ma --feature-layers 3 15 --lr 3e-4 --w-ce 1.0 --w-l1 0.1" \
    A_ARGS="--answer-tokens 128" B_ARGS="--answer-tokens 128" STEPS=${STEPS:-2000} TB=${TB:-300} \
    TPC_S=${TPC_S:-200} TPC_EXTRA="${DEV:-}" setsid nohup bash tools/device/ab_train.sh > $W/ab.log 2>&1 < /dev/null &)
  sleep 25; tail -n 2 $W/a.log; echo "== end [t=$(el)]" ;;
2)
  while pgrep -f ab_train.sh > /dev/null; do sleep 5; done
  cat $W/ab.log; cp $W/abo/* $OUT/; ls -la $OUT ;;
esac
