#!/usr/bin/env bash
# Two draft-training variants side by side on one GPU (the same data, steps and seed; A_ARGS and B_ARGS differ), then
# MT-Bench TPC of both. Call 2 or later of tools/device/README.md (the GGUF's first half and the data copied to $S in
# call 1). Comes back in $OUT: tpc.json, and both drafts in a tar of 6 MB parts (`cat ab.tar.part* | tar xf -`).
#   A_ARGS="--answer-tokens 128" B_ARGS="" STEPS=480 TB=90 bash tools/device/ab_train.sh
# A_GPU / B_GPU (default 0 and 0) put the variants on GPUs of their own (nvidia-h200-x2: A_GPU=0 B_GPU=1).
# D: the training data (default: the file call 1 copied to /root/stage; session 10 carried it in call 2 instead:
# D=$PWD/.stage/regen3/regen_runD_self.jsonl.xz). A_ARGS with --layers 2 grows the draft by a layer (run J).
# A_DATA / B_DATA: a variant's own data files (default: D), e.g. D plus tools/device/starts_data.sh's output.
# PART_SIZE: the tar's part size (default 6M; $OUT returns at most 8 files of at most 16 MiB).
# STAGED=1 S=... W=... OUT=... D=... EXTRA="--limit 20 --batch-tokens 2048 --device cpu" makes a CPU dry run.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
source tools/device/stage_smollm2.sh > /dev/null 2>&1
[ -n "${STAGED:-}" ] || [ -f $S/smollm2.gguf ] || { echo "staging failed"; exit 1; }
D=${D:-/root/stage/regen_runD_self.jsonl.xz}
BASE=${BASE_ARGS:---layers 1 --unroll 3 --init eyas/drafts/smollm2 --feature-layers 3 15 --lr 3e-4 --w-ce 1.0 --w-l1 0.1}
COMMON="--target smollm2 $BASE --epochs 100 --max-steps ${STEPS:-500} --time-budget ${TB:-100} \
  --heldout ${HO:-64} --tpc-prompts 0 --no-progress ${EXTRA:-}"
echo "== train A (${A_ARGS:-}) and B (${B_ARGS:-}) [t=$(el)]"
CUDA_VISIBLE_DEVICES=${A_GPU:-0} python3 -m eyas.train.trainer --data ${A_DATA:-$D} $COMMON ${A_ARGS:-} --out $W/a > $W/a.log 2>&1 &
CUDA_VISIBLE_DEVICES=${B_GPU:-0} python3 -m eyas.train.trainer --data ${B_DATA:-$D} $COMMON ${B_ARGS:-} --out $W/b > $W/b.log 2>&1 &
wait
for x in a b; do echo "-- $x"; grep -a '"steps"\|tokens_per_second\|acc_by_depth' -A3 $W/$x.log | tr -d ' \n' | head -c 400; echo; done
(cd $W && tar cf - {a,b}/model.safetensors {a,b}/config.json {a,b}/training.json | split -b ${PART_SIZE:-6M} -d - $OUT/ab.tar.part)
echo "== tpc [t=$(el)]"
timeout ${TPC_S:-90} python3 -m eyas.bench.tpc --model smollm2 --draft $W/a $W/b --speculation chain:3 \
  --speculation tree:smollm2_48d5 --temperature 0 --max-tokens 128 --prompts $S/question.jsonl ${TPC_EXTRA:-} \
  --out $W/tpc 2>&1 | grep "^|"
cp $W/tpc/tpc.json $OUT/ 2>/dev/null
echo "== end [t=$(el)]"
