#!/usr/bin/env bash
# Call 2 of tools/device/README.md, on the GPU machine: finish staging, regenerate first turns with SmolLM2 (greedy) --
# or take a regenerated file carried in call 1 (REGEN_FILE) -- optionally add SELF_PROMPTS prompts written by SmolLM2
# itself and answered by it (eyas make-prompts + make-distill-data), probe the training speed, then start the draft
# training as a detached process that outlives this call (call 3 waits for it). With TRAIN_ARGS_B a second variant
# trains at the same time on the same data, into $W/t2 (a controlled comparison; each gets about half the GPU).
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
EXTRA_STAGE=$(ls -d .stage/${STAGE_C:-c3}/* 2>/dev/null | tr "\n" " ")  # STAGE_C: the data folder carried with .stage/b
source tools/device/stage_smollm2.sh
if [ -n "${REGEN_FILE:-}" ]; then
  echo "== regenerated data carried: $REGEN_FILE [t=$(el)]"
  REGEN=$W/$(basename $REGEN_FILE)   # .jsonl.gz or .jsonl.xz
  cp $REGEN_FILE $REGEN || exit 1
else
  echo "== regenerate [t=$(el)]"
  REGEN=$W/regen.jsonl.gz
  python3 -m eyas.train.distill_data --model smollm2 --data $S/p1.jsonl.gz $S/p2.jsonl.gz --out $W/regen.jsonl.gz \
    --max-tokens 512 --batch-size 256 --max-turns 1 --max-prompt-tokens 1024 --time-budget ${REGEN_S:-190} \
    --no-progress 2>&1 | tail -n 5 | tee $OUT/regen.json
  cp $W/regen.jsonl.gz $OUT/ 2>/dev/null
fi
SELF=""
if [ -n "${SELF_PROMPTS:-}" ]; then
  # prompts written by SmolLM2 itself (eyas make-prompts), answered by it (greedy; with REGEN_SPEC, e.g.
  # "--draft default --speculation chain:3", through speculative decoding, with a plain fallback)
  echo "== self-written prompts: $SELF_PROMPTS, budget ${SELF_S:-60} s [t=$(el)]"
  python3 -m eyas.train.self_instruct --model smollm2 --num $SELF_PROMPTS --out $W/self_prompts.jsonl.gz \
    --batch-size ${SELF_BATCH:-512} --time-budget ${SELF_S:-60} --no-progress 2>&1 | tail -n 3 | tee $OUT/self_prompts.json
  echo "== answer them, budget ${SELF_REGEN_S:-150} s [t=$(el)]"
  REGEN_CMD="python3 -m eyas.train.distill_data --model smollm2 --data $W/self_prompts.jsonl.gz \
    --out $W/self_regen.jsonl.gz --max-tokens ${SELF_MAX_TOKENS:-512} --batch-size 256 --max-turns 1 --max-prompt-tokens 1024 \
    --time-budget ${SELF_REGEN_S:-150} --no-progress"
  $REGEN_CMD ${REGEN_SPEC:-} > $W/self_regen.log 2>&1 || { echo "(speculative regeneration failed: plain)";
    tail -n 5 $W/self_regen.log; $REGEN_CMD > $W/self_regen.log 2>&1; }
  tail -n 3 $W/self_regen.log | tee $OUT/self_regen.json
  cp $W/self_prompts.jsonl.gz $W/self_regen.jsonl.gz $OUT/ 2>/dev/null
  SELF="$W/self_regen.jsonl.gz"
fi
DATA="$REGEN $SELF $(ls $S/sharegpt-train-*.jsonl.gz 2>/dev/null | tr '\n' ' ')"
echo "== data: $DATA"
# TRAIN_ARGS: the run's own options (e.g. "--layers 1 --unroll 3 --init eyas/drafts/smollm2 --lr 4e-4"); the probe
# runs with the same ones, so that its speed is the run's
TRAIN_ARGS=${TRAIN_ARGS:---layers 1 --lr 6e-4}
TRAIN_ARGS_B=${TRAIN_ARGS_B:-}
echo "== probe [t=$(el)]"
python3 -m eyas.train.trainer --target smollm2 --data $DATA $TRAIN_ARGS --out $W/probe --max-steps ${PROBE_STEPS:-40} \
  --tpc-prompts 0 --heldout 8 --no-progress 2>&1 | tail -n 12 | tee $OUT/probe.txt
TRAIN_S=${TRAIN_S:-520}
# two runs side by side share the GPU: each is sized for about 0.6 of the probe's speed (the time budget stops
# them in any case, but a schedule cut short never reaches the cosine's low end)
SHARE=$([ -n "$TRAIN_ARGS_B" ] && echo 0.6 || echo 1.05)
read STEPS EV < <(python3 - <<PY
import json
a = json.load(open("$W/probe/training.json"))
per_step = a["tokens_seen"] / max(a["steps"], 1)
steps = int(a["tokens_per_second"] * $SHARE * $TRAIN_S / per_step)   # the probe's first steps include warm-up
print(steps, max(steps // ${EVALS:-3}, 100))
PY
)
COMMON="--target smollm2 --data $DATA --epochs 100 --max-steps $STEPS --time-budget $TRAIN_S --eval-every $EV \
  --save-every $EV --heldout 64 --tpc-prompts 32 --tpc-max-tokens 64 --no-progress"
echo "== train: $STEPS steps, eval every $EV, budget $TRAIN_S s [t=$(el)]"
setsid bash -c "python3 -m eyas.train.trainer $COMMON $TRAIN_ARGS --out $W/t1 > $W/train.log 2>&1; touch $W/train.done" \
  < /dev/null > /dev/null 2>&1 &
if [ -n "$TRAIN_ARGS_B" ]; then
  echo "== and variant B: $TRAIN_ARGS_B"
  setsid bash -c "python3 -m eyas.train.trainer $COMMON $TRAIN_ARGS_B --out $W/t2 > $W/train2.log 2>&1; touch $W/train2.done" \
    < /dev/null > /dev/null 2>&1 &
fi
done_all() { [ -f $W/train.done ] && { [ -z "$TRAIN_ARGS_B" ] || [ -f $W/train2.done ]; }; }
while [ $(el) -lt ${CALL_S:-585} ] && ! done_all; do sleep 10; done
echo "== call 2 ends [t=$(el)]"; for L in $W/train.log $W/train2.log; do [ -f $L ] && { echo "-- $L"; grep -a "eval step" $L | tail -n 3; tail -c 400 $L; }; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
