#!/usr/bin/env bash
# Issue #4, run T (session 46, call 4, with D=/root/w: call 3 had regenerated the answers with `LATER=0
# PHASE=data bash tools/device/later_turns_ab.sh`; docs/draft-training.md, "Run T"): run S's sharper labels
# (`--ce-temperature 0.25`: +1.9% of T=0's `chain:3` over its control, but the default tree's T=1 acceptance -5.3%)
# against a hard-label term beside the unsharpened soft one (`--w-hard 1.0`, eyas/train/loss.py), which might keep
# T=1 while buying T=0. Each variant continues the shipped draft 1,500 steps side by side on one H200, on run S's
# answers carried back (every kind the shipped draft was trained on: .stage/s45/{starts,sg,ctx}.jsonl.xz, 7.4 MB
# with later.jsonl.xz, which is not used):
#   b: the control; s: `--ce-temperature 0.25` (run S's s again: is its +1.9% real?); h: `--w-hard 1.0`.
# Then MT-Bench TPC (80 first turns x 128) of the three, `chain:3` and the default tree, at T=0 and T=1.
# Calls (send each at once after the one before: the machine goes back after 30 s idle):
#   1 (carry .stage/a): mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
#   2 (carry .stage/b): cp .stage/b/part_ab /root/stage/
#   3 (carry .stage/c .stage/s45; ~8 min): bash tools/device/hard_labels_ab.sh   (trains, measures, packs the drafts)
# .stage/s45: run S's answers (session 45, call 3's $OUT: docs/draft-training.md, "Run S").
# Env: STEPS (1500), TB (training seconds, 300), TPC_S (280). A CPU dry run:
#   mkdir -p /tmp/s && cp ../shared/data/mt_bench/question.jsonl /tmp/s/ && STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o \
#     STEPS=2 TB=60 EXTRA="--limit 8 --batch-tokens 1024 --device cpu" \
#     TPC_EXTRA="--limit 2 --max-tokens 8 --device cpu" bash tools/device/hard_labels_ab.sh
set -u
export OUT
source tools/device/thirds_lib.sh
D=${D:-.stage/s45}
stage_thirds || exit 1
ALL="$D/starts.jsonl.xz $D/sg.jsonl.xz $D/ctx.jsonl.xz"
COMMON=$(continue_args 300)
echo "== train b, s, h [t=$(el)]"
python3 -m eyas.train.trainer --data $ALL $COMMON --out $W/b > $W/b.log 2>&1 &
python3 -m eyas.train.trainer --data $ALL $COMMON --ce-temperature 0.25 --out $W/s > $W/s.log 2>&1 &
python3 -m eyas.train.trainer --data $ALL $COMMON --w-hard 1.0 --out $W/h > $W/h.log 2>&1 &
wait
report_and_pack hard_labels b s h
TPC_S=${TPC_S:-280} mt_bench_tpc "0 1" $W/b $W/s $W/h
ls -la $OUT
echo "== end [t=$(el)]"
