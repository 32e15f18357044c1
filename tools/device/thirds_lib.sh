# Sourced by the device scripts that stage SmolLM2's GGUF in thirds (wide_ab.sh, mix_ab.sh; their headers give the
# calls): S, W and C=.stage/c set, $S, $W and $OUT made, a clock (`el`: seconds since sourcing), and
# stage_thirds: joins the two thirds earlier calls copied to $S with .stage/c's, checks it, installs the carried gguf
#   wheel and stages MT-Bench (stage_smollm2.sh, which reads .stage/b: the wheel and question.jsonl are put there);
#   STAGED=1 (a CPU dry run) skips the joining;
# answer NAME FILES BUDGET: SmolLM2 answers the first user turns of FILES (one name or several, quoted; in $C,
#   .stage/c unless ANS_DIR) greedily (at most MAX_TOK, 160, tokens; batches of R_BATCH, 256; BUDGET seconds; DEV and
#   LIMIT for dry runs) into $W/NAME.jsonl.xz.
S=${S:-/root/stage}; W=${W:-/root/w}; C=.stage/c
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $S $W $OUT

stage_thirds() {
  if [ -z "${STAGED:-}" ] && [ -f $S/part_aa ]; then
    cat $S/part_aa $S/part_ab $C/part_ac > $S/smollm2.gguf && rm $S/part_aa $S/part_ab
  fi
  mkdir -p .stage/b && cp $C/gguf-*.whl $C/question.jsonl .stage/b/
  source tools/device/stage_smollm2.sh > /dev/null 2>&1
  [ -n "${STAGED:-}" ] || [ -f $S/smollm2.gguf ] || { echo "staging failed"; return 1; }
}

answer() {
  local f data=()
  for f in $2; do data+=(${ANS_DIR:-$C}/$f); done
  echo "== answer $1 ($2), $3 s [t=$(el)]"
  python3 -m eyas.train.distill_data --model smollm2 --data "${data[@]}" --out $W/$1.jsonl.xz --max-tokens ${MAX_TOK:-160} \
    --batch-size ${R_BATCH:-256} --max-turns 1 --max-prompt-tokens 1024 --time-budget $3 --draft default \
    --speculation chain:3 --no-progress ${DEV:-} ${LIMIT:+--limit $LIMIT} 2>&1 | tail -n 1
}

# report_and_pack TAR NAME...: each draft trained into $W/NAME (log $W/NAME.log): its steps, tokens/s and held-out
#   accuracy by depth, and the log's tail; then their weights, config.json and training.json packed into
#   $OUT/TAR.tar.partNN (PART_SIZE, 15M a part).
report_and_pack() {
  local tar=$1 x files=()
  shift
  for x in "$@"; do
    echo "-- $x"; grep -a '"steps"\|tokens_per_second\|acc_by_depth' -A3 $W/$x.log | tr -d ' \n' | head -c 400; echo
    tail -n 2 $W/$x.log | cut -c1-300
    files+=($x/model.safetensors $x/config.json $x/training.json)
  done
  (cd $W && tar cf - "${files[@]}" | split -b ${PART_SIZE:-15M} -d - $OUT/$tar.tar.part)
}
