# Issue #5's rows with `eyas bench latency --repeat` (written in session 16 for the next one): the modes of a row
# group interleaved in one process, the run of median TTIT reported, every run's TTIT kept. Each stage returns one
# archive, $OUT/repeat_<stage>.tar.gz, and prints its rows.
# STAGE=1 (carry .stage/a; copies part_aa to /root/stage for stage 2): the 8B shape at 1k context with run L's FP8 +
#   32k rank paths (points 1 and 3): plain and chain:3, folded and `--no-fold-norms`; then a profile of the chain:3
#   step both ways (did the folded norms save their 64 launches, or did cuBLAS's beta-add GEMMs take them back?).
# STAGE=2 (carry .stage/b, after stage 1): SmolLM2 over the MT-Bench first turns (point 2a): plain, chain:3 and the
#   default tree; then the tree with `--no-few-rows` (its 49-row verify is on cuBLAS either way, so this isolates
#   the draft's tree levels on the tile kernels, which session 16 could not settle); then the tree with an FP8 draft
#   (`--draft-quant fp8`: its 57 MB head, read at every level, halved; -0.5% TPC in session 13's CPU replay).
# Both stages keep the profiled steps' kernels in launch order (`--profile`'s kernels_*.tsv) in their archive.
# Env: NP (prompts, 80), MAXT (tokens, 128), REPEAT (3); ROWS8B= (empty: stage 1 profiles only), PROF8B (the modes
# stage 1 profiles, chain:3); L8B_MODEL (llama-3.1-8b-shape) and STAGED=1 for a dry run
# on the CPU (`STAGED=1 STAGE=2 NP=1 MAXT=4 REPEAT=2 OUT=/tmp/o bash tools/device/repeat_rows.sh`).
set -u
NP=${NP:-80}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}
if [ "${STAGE:-1}" = 1 ]; then
  [ -z "${STAGED:-}" ] && mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  R=${W:-/root/w}/repeat1; mkdir -p $R $OUT
  L8B="python3 -m eyas.cli bench latency --model ${L8B_MODEL:-llama-3.1-8b-shape} --context 1024 --draft-vocab 32768 \
    --draft-quant fp8 --accept-ranks docs/bench/ranks_smollm2_runL_dv32s_fp8_cpu.safetensors --batch-sizes 1"
  for f in "" --no-fold-norms; do
    [ -n "${ROWS8B-1}" ] && $L8B --num-prompts $NP --max-tokens $MAXT --modes plain,chain:3 --repeat $REPEAT $f \
      --out $R/l8b${f:+_nofold} 2>&1 | grep "^| [pc]" | sed "s/^/${f:-folded} /"
    $L8B --num-prompts 1 --max-tokens 32 --modes ${PROF8B:-chain:3} --profile $f --out $R/prof${f:+_nofold} \
      > $R/profile${f:+_nofold}.txt 2>&1
    grep "GPU kernels per step" $R/profile${f:+_nofold}.txt | sed "s/^/${f:-folded} /"
  done
  (cd $R/.. && tar czf $OUT/repeat_1.tar.gz repeat1)
else
  source tools/device/stage_smollm2.sh
  R=$W/repeat2; mkdir -p $R
  LAT="python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens $MAXT --prompts $S/question.jsonl \
    --batch-sizes 1 --num-prompts $NP --repeat $REPEAT"
  $LAT --modes plain,chain:3,tree:smollm2_48d5 --out $R/sm 2>&1 | grep "^| [pct]"
  $LAT --modes tree:smollm2_48d5 --no-few-rows --out $R/sm_nofew 2>&1 | grep "^| [pct]" | sed "s/^/no-few-rows /"
  $LAT --modes tree:smollm2_48d5 --draft-quant fp8 --out $R/sm_fp8 2>&1 | grep "^| [pct]" | sed "s/^/fp8-draft /"
  python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens 64 --prompts $S/question.jsonl \
    --batch-sizes 1 --num-prompts 2 --modes plain,chain:3,tree:smollm2_48d5 --profile --out $R/prof \
    > $R/profile.txt 2>&1; grep "GPU kernels per step" $R/profile.txt
  (cd $W && tar czf $OUT/repeat_2.tar.gz repeat2)
fi
