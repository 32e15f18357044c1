#!/usr/bin/env bash
# Issue #4, session 33: two loss-side levers the draft-training table had not tried, each against a control trained
# beside it. EAGLE-3 drops the feature-regression term (the draft's hidden state is free, and the unrolled steps
# train what it feeds back) and drops the feature noise (the unrolled steps replace it as the robustness device).
# Variants, all continuing the shipped draft 1,500 steps on run P B's data (opening-led prompts, ShareGPT first turns
# and passage tasks, answered by SmolLM2 in session 28 and kept in .stage/d), with mix_ab.sh's base arguments:
#   b: the control (--w-l1 0.1, uniform noise 0.2, as every run since G);
#   w: --w-l1 0 (CE only);
#   n: --noise none.
# Then MT-Bench TPC (80 first turns x 128, T=0) of the three, `chain:3` and the default tree.
# One call does it all after the GGUF's first two thirds were copied (mix_ab.sh's header, calls 1-2):
#   carry .stage/c .stage/d:  bash tools/device/loss_ab.sh
# Env: STEPS (1500), TB (training seconds, 300), TPC_S (260), VARIANTS ("b=;w=--w-l1 0;n=--noise none").
# A CPU dry run:
#   STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o STEPS=2 TB=60 TPC_S=120 EXTRA="--limit 20 --batch-tokens 2048 --device cpu" \
#     TPC_EXTRA="--limit 2 --max-tokens 8 --device cpu" bash tools/device/loss_ab.sh
set -u
export OUT
source tools/device/thirds_lib.sh
stage_thirds || exit 1
D=${D:-.stage/d}
DATA="$D/starts12.jsonl.xz $D/sg.jsonl.xz $D/ctx.jsonl.xz"
COMMON=$(continue_args 300)
names=()
IFS=';' read -ra vs <<< "${VARIANTS:-b=;w=--w-l1 0;n=--noise none}"
echo "== train ${#vs[@]} variants [t=$(el)]"
for v in "${vs[@]}"; do
  name=${v%%=*}; args=${v#*=}; names+=($name)
  python3 -m eyas.train.trainer --data $DATA $COMMON $args --out $W/$name > $W/$name.log 2>&1 &
done
wait
report_and_pack loss_ab "${names[@]}"
dirs=(); for x in "${names[@]}"; do dirs+=($W/$x); done
TPC_S=${TPC_S:-260} mt_bench_tpc 0 "${dirs[@]}"
echo "== end [t=$(el)]"
