#!/usr/bin/env bash
# Issue #4, run U (session 47): averaged drafts ("soups", `eyas average-drafts`). Run T's three continuations of the
# shipped draft (b: control, s: `--ce-temperature 0.25`, h: `--w-hard 1.0`; session 46, call 4's $OUT) are carried in
# the staging calls; this call trains three more continuations beside each other that differ from run T's control in
# their seed alone (the batch order and the feature noise), then measures MT-Bench TPC (80 first turns x 128, T=0,
# `chain:3` and the default tree) of the shipped draft and of three soups:
#   soup4: shipped + b + s + h (on the CPU: chain:3 2.425 against the shipped 2.400);
#   soupr: shipped + r1 + r2 + r3;
#   soup7: all seven.
# Calls (send each at once after the one before: the machine goes back after 30 s idle):
#   1 (carry .stage/a .stage/t47a): mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/ && cp -r .stage/t47a/b /root/stage/
#   2 (carry .stage/b .stage/t47b): cp .stage/b/part_ab /root/stage/ && cp -r .stage/t47b/s /root/stage/
#   3 (carry .stage/c .stage/s46 .stage/t47c; ~8 min): bash tools/device/soup_ab.sh
# Env: STEPS (1500), TB (training seconds, 300), TPC_S (200), TEMPS ("0"). A CPU dry run:
#   mkdir -p /tmp/s/b /tmp/s/s && cp ../shared/data/mt_bench/question.jsonl /tmp/s/ && cp .stage/t47a/b/* /tmp/s/b/ &&
#   cp .stage/t47b/s/* /tmp/s/s/ && STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o STEPS=2 TB=60 \
#   EXTRA="--limit 8 --batch-tokens 1024 --device cpu" TPC_EXTRA="--limit 2 --max-tokens 8 --device cpu" \
#   bash tools/device/soup_ab.sh
set -u
export OUT
source tools/device/thirds_lib.sh
D=${D:-.stage/s46}
stage_thirds || exit 1
cp -r .stage/t47c/h $S/ || exit 1
for x in b s h; do [ -f $S/$x/model.safetensors ] || { echo "run T's draft $x is not staged in $S"; exit 1; }; done
ALL="$D/starts.jsonl.xz $D/sg.jsonl.xz $D/ctx.jsonl.xz"
COMMON=$(continue_args 300)
echo "== train r1, r2, r3 [t=$(el)]"
for i in 1 2 3; do
  python3 -m eyas.train.trainer --data $ALL $COMMON --seed $i --out $W/r$i > $W/r$i.log 2>&1 &
done
wait
echo "== soups [t=$(el)]"
avg() { local out=$1; shift; python3 -m eyas.train.average "$@" --out $W/$out > $W/$out.log 2>&1; tail -c 300 $W/$out.log; }
avg soup4 default $S/b $S/s $S/h
avg soupr default $W/r1 $W/r2 $W/r3
avg soup7 default $S/b $S/s $S/h $W/r1 $W/r2 $W/r3
report_and_pack soup r1 r2 r3 soup4 soupr soup7
TPC_S=${TPC_S:-200} mt_bench_tpc "${TEMPS:-0}" default $W/soup4 $W/soupr $W/soup7
ls -la $OUT
echo "== end [t=$(el)]"
