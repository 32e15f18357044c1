#!/usr/bin/env bash
# Call 2 of tools/device/README.md, on the GPU machine: finish staging, regenerate first turns with SmolLM2 (greedy), probe the training
# speed, then start the draft training as a detached process that outlives this call (call 3 waits for it).
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
S=/root/stage; W=/root/w; mkdir -p $W $OUT
cat $S/part_aa .stage/b/part_ab > $S/smollm2.gguf && rm $S/part_aa
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $S/smollm2.gguf" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .stage/b/*.whl || exit 1
cp .stage/c3/* .stage/b/question.jsonl $S/
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD EYAS_SMOLLM2_GGUF=$S/smollm2.gguf TOKENIZERS_PARALLELISM=true
echo "== regenerate [t=$(el)]"
python3 -m eyas.train.distill_data --model smollm2 --data $S/p1.jsonl.gz $S/p2.jsonl.gz --out $W/regen.jsonl.gz \
  --max-tokens 512 --batch-size 256 --max-turns 1 --max-prompt-tokens 1024 --time-budget ${REGEN_S:-190} \
  --no-progress 2>&1 | tail -n 5 | tee $OUT/regen.json
cp $W/regen.jsonl.gz $OUT/ 2>/dev/null
DATA="$W/regen.jsonl.gz $S/sharegpt-train-00.jsonl.gz $S/sharegpt-train-02.jsonl.gz"
echo "== probe [t=$(el)]"
# TRAIN_ARGS: the run's own options (e.g. "--layers 1 --unroll 3 --init eyas/drafts/smollm2 --lr 4e-4"); the probe
# runs with the same ones, so that its speed is the run's
TRAIN_ARGS=${TRAIN_ARGS:---layers 1 --lr 6e-4}
python3 -m eyas.train.trainer --target smollm2 --data $DATA $TRAIN_ARGS --out $W/probe --max-steps ${PROBE_STEPS:-40} \
  --tpc-prompts 0 --heldout 8 --no-progress 2>&1 | tail -n 12 | tee $OUT/probe.txt
TRAIN_S=${TRAIN_S:-520}
read STEPS EV < <(python3 - <<PY
import json
a = json.load(open("$W/probe/training.json"))
per_step = a["tokens_seen"] / max(a["steps"], 1)
steps = int(a["tokens_per_second"] * 1.05 * $TRAIN_S / per_step)   # the probe's first steps include warm-up
print(steps, max(steps // ${EVALS:-3}, 100))
PY
)
echo "== train: $STEPS steps, eval every $EV, budget $TRAIN_S s [t=$(el)]"
setsid bash -c "python3 -m eyas.train.trainer --target smollm2 --data $DATA $TRAIN_ARGS --out $W/t1 --epochs 100 \
  --max-steps $STEPS --time-budget $TRAIN_S --eval-every $EV --save-every $EV --heldout 64 \
  --tpc-prompts 32 --tpc-max-tokens 64 --no-progress > $W/train.log 2>&1; touch $W/train.done" < /dev/null > /dev/null 2>&1 &
while [ $(el) -lt ${CALL_S:-585} ] && [ ! -f $W/train.done ]; do sleep 10; done
echo "== call 3 ends [t=$(el)]"; grep -a "eval step" $W/train.log | tail -n 5; tail -c 600 $W/train.log
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
