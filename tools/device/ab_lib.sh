# Sourced by the device scripts that time a module-level switch in processes alternated on one machine
# (attn_pdl_ab.sh, replay_ab.sh, fused_pdl_ab.sh) and by those whose first stage only stages the GGUF's first half
# and whose second stage stages SmolLM2 (stage_b).

# The 8B shape's rows of record: 1k context, FP8 draft with a 32k draft vocabulary, the shipped draft's rank paths
# replayed (run N A's recorded on the H200 since session 24; its CPU recording in session 23; run L's before).
L8B="bench latency --model llama-3.1-8b-shape --context 1024 --draft-vocab 32768 --draft-quant fp8 \
--accept-ranks docs/bench/ranks_smollm2_runNa_dv32s_fp8_gpu.safetensors"

# begin DIR: how an A/B script without staging starts: eyas on the path, R=${W:-/root/w}/DIR and $OUT made, and a
# clock (`el`: seconds since begin).
begin() {
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT
  R=${W:-/root/w}/$1; mkdir -p $R $OUT
  T0=$(date +%s)
}
el() { echo $(( $(date +%s) - T0 )); }

# gpu_tests SECONDS PYTEST_ARGS...: unless TESTS=0, the GPU tests named (pytest, under a timeout), their tail printed.
gpu_tests() {
  local s=$1
  shift
  [ "${TESTS:-1}" = 1 ] || return 0
  echo "== tests [t=$(el)]"
  timeout $s python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -n 3
}

# stage_a DIR: the first call's staging (the GGUF's first half to /root/stage, for a later call's
# stage_smollm2.sh), eyas on the path, and R=${W:-/root/w}/DIR and $OUT made.
stage_a() {
  mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  R=${W:-/root/w}/$1; mkdir -p $R $OUT
}

# stage_b DIR: a later call's staging (stage_smollm2.sh: the GGUF joined, the gguf wheel, MT-Bench in $S), then
# R=$W/DIR made.
stage_b() {
  source tools/device/stage_smollm2.sh
  R=$W/$1; mkdir -p $R
}

# alternate NAME SET PATTERN OUTPREFIX EYAS_ARGS...: for each value of ORDER (default "1 0 1 0"), one process that
# sets the switch (SET: Python lines that read `on`, a bool) and then runs `eyas EYAS_ARGS --out OUTPREFIX_<i>`;
# prints its lines matching PATTERN (grep), each prefixed "<i> NAME=<value> ".
alternate() {
  local name=$1 set=$2 pattern=$3 out=$4 i=0 v run
  shift 4
  run="import sys
on = bool(int(sys.argv.pop(1)))
$set
from eyas.cli import main
sys.argv = ['eyas'] + sys.argv[1:]
main()"
  for v in ${ORDER:-1 0 1 0}; do
    i=$((i + 1))
    python3 -c "$run" $v "$@" --out ${out}_$i 2>&1 | grep "$pattern" | sed "s/^/$i $name=$v /"
  done
}

# switch_run TAG MODULE LINE EYAS_ARGS...: one process that imports MODULE as m, runs LINE (a switch, e.g.
# "m.EXACT_K = True"), then `eyas EYAS_ARGS --out $OUT/TAG`; its output goes to $OUT/TAG.log, whose tail is printed
# if it fails.
switch_run() {
  local tag=$1 mod=$2 line=$3
  shift 3
  python3 -c "import sys; import $mod as m; $line; from eyas.cli import main; sys.exit(main(sys.argv[1:]))" \
    "$@" --out $OUT/$tag > $OUT/$tag.log 2>&1 || tail -n 5 $OUT/$tag.log
}

# SMALL_END: a `switch_run` line (eyas.kernels.decode_linear as m) that puts the register kernel's small weights back
# at PDL trigger "end", where they were until session 39 ("start" since).
SMALL_END="import dataclasses; f = m.default_decode_config; m.default_decode_config = lambda *a, **k: dataclasses.replace(f(*a, **k), trigger='end')"

# main_vs NAME SET EYAS_ARGS...: for each value of ORDER (default "main NAME NAME main"), one `switch_run` tagged
# <value>_<i> of `eyas EYAS_ARGS` with eyas.kernels.decode_linear as m, SET run first for NAME ("pass" for main).
main_vs() {
  local name=$1 set=$2 i=0 v line
  shift 2
  for v in ${ORDER:-main $name $name main}; do
    i=$((i + 1))
    echo "== $v [t=$(el)]"
    if [ $v = main ]; then line="pass"; else line="$set"; fi
    switch_run ${v}_$i eyas.kernels.decode_linear "$line" "$@"
  done
}

# mtbench_ab MOD: for each value v of ORDER while under BUDGET (440) seconds, one `switch_run` tagged v_<i> of the real
# SmolLM2's MT-Bench rows (80 x 128 unless NP, batch sizes BATCHES or 1, `--repeat` REPEAT or 1; plain, `chain:3`
# and the default tree) with MOD imported as m and the Python lines of the shell variable named v run first (none for
# main); then the rows (`latency_rows`), and the runs' folders packed into $OUT/rows.tar.gz. Needs stage_thirds' $S.
mtbench_ab() {
  local mod=$1 i=0 v line
  for v in $ORDER; do
    [ $(el) -gt ${BUDGET:-440} ] && break
    i=$((i + 1))
    if [ $v = main ]; then line="pass"; else line="${!v}"; fi
    switch_run ${v}_$i $mod "$line" bench latency --model smollm2 --draft default --max-tokens 128 \
      --prompts $S/question.jsonl --batch-sizes ${BATCHES:-1} --num-prompts ${NP:-80} --repeat ${REPEAT:-1} \
      --modes plain,chain:3,tree:smollm2_48d5
    echo "$v done [t=$(el)]"
  done
  latency_rows
  (cd $OUT && tar czf rows.tar.gz *_[0-9]* && rm -rf *_[0-9]*)
}

# s2_run TAG LINES EYAS_ARGS...: `switch_run` of `eyas bench latency` on smollm2-shape (run N A's bf16 rank paths
# replayed; batch 1, 8 prompts x 64 tokens, plain and the default tree unless EYAS_ARGS says otherwise), LINES run
# first with eyas.kernels.tree_attention as m and eyas.engine.cuda_graph as cg; prints the seconds it took.
s2_run() {
  local tag=$1 line=$2 t0=$(date +%s)
  shift 2
  switch_run $tag eyas.kernels.tree_attention "import eyas.engine.cuda_graph as cg; $line" bench latency \
    --model smollm2-shape --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors \
    --batch-sizes 1 --num-prompts 8 --max-tokens 64 --modes plain,tree:smollm2_48d5 "$@"
  echo "$tag $(( $(date +%s) - t0 )) s"
}

# latency_rows: one line for each row of every $OUT/*/latency.json (its folder, mode, batch, TTIT, ms a step, TPC).
latency_rows() {
  python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*/latency.json")):
    for r in json.load(open(f)).get("results", []):
        print(f.split("/")[-2], r["mode"], r["batch"], "ttit", round(r["ttit_ms"], 4), "step",
              round(r["ms_per_decode_step"], 4), "tpc", round(r["tpc"], 3))
PY
}
