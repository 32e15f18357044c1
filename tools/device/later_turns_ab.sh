#!/usr/bin/env bash
# Issue #4, run S (session 45): two levers never tried, each against a control trained beside it on one H200. Every
# variant continues the shipped draft (`--init eyas/drafts/smollm2`) 1,500 steps on every kind of data it was trained
# on, regenerated here (SmolLM2's greedy answers, at most 160 tokens): opening-led prompts (openings.txt +
# openings2.txt, seed 5, as runs M and P), ShareGPT first turns and passage tasks; then
#   b: that alone (the control);
#   t: + ShareGPT's later user turns, each answered as a first turn (29,013 of them: twice the first turns, never
#      used: every run so far answered first turns only);
#   s: `--ce-temperature 0.25` (labels sharpened towards the target's argmax, what greedy acceptance needs; run M's
#      0.5 gave +1.0%, inside the noise).
# Then MT-Bench TPC (80 first turns x 128, T=0) of the three, `chain:3` and the default tree.
# Calls (send each at once after the one before: the machine goes back after 30 s idle):
#   1 (carry .stage/a): mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
#   2 (carry .stage/b): cp .stage/b/part_ab /root/stage/
#   3 (carry .stage/c .stage/f; ~8 min): PHASE=data bash tools/device/later_turns_ab.sh   (the answers come back)
#   4 (warm, no carry; ~7 min): PHASE=train bash tools/device/later_turns_ab.sh   (trains, measures, packs the drafts)
# .stage/f (made on the CPU, 7 MB):
#   mkdir -p .stage/f && cp .stage/e/ctx.jsonl.gz .stage/f/   (feature_layers_ab.sh's header makes it)
#   python tools/device/first_turns.py --shuffle 45 --out .stage/f/sg_first.jsonl.gz ../shared/data/sharegpt/*.gz
#   python tools/device/first_turns.py --later --min-chars 40 --shuffle 45 --out .stage/f/sg_later.jsonl.gz \
#     ../shared/data/sharegpt/*.gz
# Env: LATER=0 (the data phase skips the later turns, as for hard_labels_ab.sh in session 46), ANS_S (answering
# seconds a kind, 90), P_S / R_S (the opening-led prompts' writing and answering, 50 / 70),
# STEPS (1500), TB (training seconds, 330), TPC_S (240). A CPU dry run:
#   STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o LIMIT=6 DEV="--device cpu" NUM=8 P_BATCH=8 R_BATCH=8 P_S=20 R_S=20 \
#     MAX_TOK=16 ANS_S=20 PHASE=data bash tools/device/later_turns_ab.sh
#   cp ../shared/data/mt_bench/question.jsonl /tmp/s/ && STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o STEPS=2 TB=60 \
#     EXTRA="--limit 8 --batch-tokens 1024 --device cpu" TPC_EXTRA="--limit 2 --max-tokens 8 --device cpu" \
#     PHASE=train bash tools/device/later_turns_ab.sh
set -u
export OUT
source tools/device/thirds_lib.sh
F=${F:-.stage/f}
if [ "${PHASE:-data}" = data ]; then
  stage_thirds || exit 1
  grep -hv '^#' tools/device/openings.txt tools/device/openings2.txt | grep . > $W/openings12.txt
  OPENINGS=$W/openings12.txt SEED=5 P_S=${P_S:-50} R_S=${R_S:-70} bash tools/device/starts_data.sh | grep -v "^-"
  rm -f $OUT/starts.jsonl.xz
  ANS_DIR=$F
  answer sg sg_first.jsonl.gz ${ANS_S:-90}
  answer ctx ctx.jsonl.gz ${ANS_S:-90}
  kinds="starts sg ctx"
  if [ "${LATER:-1}" = 1 ]; then answer later sg_later.jsonl.gz ${ANS_S:-90}; kinds="$kinds later"; fi
  for x in $kinds; do
    python3 -c "import lzma,sys; print(sys.argv[1], sum(1 for _ in lzma.open(sys.argv[2], 'rt')), 'conversations')" \
      $x $W/$x.jsonl.xz
    cp $W/$x.jsonl.xz $OUT/
  done
else
  source tools/device/stage_smollm2.sh > /dev/null 2>&1
  ALL="$W/starts.jsonl.xz $W/sg.jsonl.xz $W/ctx.jsonl.xz"
  COMMON=$(continue_args 330)
  echo "== train b, t, s [t=$(el)]"
  python3 -m eyas.train.trainer --data $ALL $COMMON --out $W/b > $W/b.log 2>&1 &
  python3 -m eyas.train.trainer --data $ALL $W/later.jsonl.xz $COMMON --out $W/t > $W/t.log 2>&1 &
  python3 -m eyas.train.trainer --data $ALL $COMMON --ce-temperature 0.25 --out $W/s > $W/s.log 2>&1 &
  wait
  report_and_pack later_turns b t s
  mt_bench_tpc 0 $W/b $W/t $W/s
fi
ls -la $OUT
echo "== end [t=$(el)]"
