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

# continue_args TB [LAYERS]: the trainer arguments of the runs that continue the shipped draft (runs P-S's base: 1
#   layer, feature layers LAYERS, "3 15" by default, lr 3e-4, w_ce 1.0, w_l1 0.1, answer starts of 128 tokens, 64
#   held out), STEPS (1500) steps within TB seconds (TB in the environment first), EXTRA appended (dry runs).
continue_args() {
  echo "--target smollm2 --layers 1 --unroll 3 --init eyas/drafts/smollm2 --feature-layers ${2:-3 15} --lr 3e-4" \
    "--w-ce 1.0 --w-l1 0.1 --answer-tokens 128 --epochs 100 --max-steps ${STEPS:-1500} --time-budget ${TB:-$1}" \
    "--heldout 64 --tpc-prompts 0 --no-progress ${EXTRA:-}"
}

# mt_bench_tpc TEMPS DIR...: MT-Bench TPC (80 first turns x 128; TPC_EXTRA for dry runs) of the drafts in DIR..., chain:3
#   and the default tree at the temperatures TEMPS (quoted, e.g. "0 1"), within TPC_S (240) seconds; its rows
#   printed, tpc.json and tpc.md to $OUT.
mt_bench_tpc() {
  local temps=$1
  shift
  echo "== tpc [t=$(el)]"
  timeout ${TPC_S:-240} python3 -m eyas.bench.tpc --model smollm2 --draft "$@" --speculation chain:3 \
    --speculation tree:smollm2_48d5 --temperature $temps --max-tokens 128 --prompts $S/question.jsonl \
    ${TPC_EXTRA:-} --out $W/tpc > $W/tpc.log 2>&1 || tail -n 5 $W/tpc.log
  grep "^|" $W/tpc.log
  cp $W/tpc/tpc.json $W/tpc/tpc.md $OUT/ 2>/dev/null
}
