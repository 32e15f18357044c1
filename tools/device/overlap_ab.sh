# Overlapped decoding (EngineConfig.overlap, eyas.spec.carry) against reading every step back first (`--no-overlap`),
# processes alternated on one machine (on, off, on, off). Session 19. Each stage returns $OUT/overlap_<stage>.tar.gz
# (the rows' JSON and markdown) and prints its rows.
# STAGE=1 (carry .stage/a; copies part_aa to /root/stage for stage 2): the GPU tests of the graphs on the tiny
#   models (overlap on against the eager path, and on against off), then the 8B shape at 1k context with run L's
#   FP8 + 32k rank paths (points 1 and 3): plain and chain:3.
# STAGE=2 (carry .stage/b, after stage 1): the SmolLM2 graph tests, then SmolLM2 over the MT-Bench first turns
#   (point 2a): plain, chain:3 and the default tree.
# Env: NP8B (16), NP (40), MAXT (128), REPEAT (3), TESTS (1: run the GPU tests first).
set -u
NP8B=${NP8B:-16}; NP=${NP:-40}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}; export OUT
PYTEST="python3 -m pytest -q -p no:cacheprovider -x"
source tools/device/ab_lib.sh
if [ "${STAGE:-1}" = 1 ]; then
  stage_a overlap1
  [ "${TESTS:-1}" = 1 ] && timeout 240 $PYTEST tests/test_cuda_graph.py -k "not smollm2" 2>&1 | tail -3
  i=0
  for f in "" --no-overlap "" --no-overlap; do
    i=$((i + 1))
    python3 -m eyas.cli $L8B --batch-sizes 1 --num-prompts $NP8B --max-tokens $MAXT --modes plain,chain:3 --repeat $REPEAT $f --out $R/l8b_$i \
      2>&1 | grep "^| [pc]" | sed "s/^/$i ${f:-overlap} /"
  done
  (cd $R/.. && tar czf $OUT/overlap_1.tar.gz overlap1)
else
  stage_b overlap2
  [ "${TESTS:-1}" = 1 ] && timeout 200 $PYTEST tests/test_cuda_graph.py -k smollm2 2>&1 | tail -3
  LAT="python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens $MAXT --prompts $S/question.jsonl \
    --batch-sizes 1 --num-prompts $NP --repeat $REPEAT --modes plain,chain:3,tree:smollm2_48d5"
  i=0
  for f in "" --no-overlap "" --no-overlap; do
    i=$((i + 1))
    $LAT $f --out $R/sm_$i 2>&1 | grep "^| [pct]" | sed "s/^/$i ${f:-overlap} /"
  done
  (cd $W && tar czf $OUT/overlap_2.tar.gz overlap2)
fi
