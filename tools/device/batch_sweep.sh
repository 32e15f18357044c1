# Session 21 (issue #5: "a real speed-up at production batch sizes"; point 3 at batch 32): ms per committed token
# (TTIT) and TPOT at batch sizes 1-64 with today's step (overlapped graphs, PDL, the few-rows path), where the last
# sweeps were sessions 5 (SmolLM2) and 13 (the 8B shape, batches 1 and 32).
# STAGE=1 (carry .stage/a; copies the GGUF's first half to /root/stage): the 8B shape at 1k context, plain and
#   chain:3 (FP8 draft, 32k draft vocabulary, run L's replayed rank paths), then the default tree.
# STAGE=2 (carry .stage/b, after stage 1): SmolLM2 and its draft over MT-Bench first turns: plain, chain:3, tree:8,
#   tree:smollm2_25, the default tree and the shipped dispatcher (eyas/drafts/smollm2/config.json).
# Env: BATCHES (1,2,4,8,16,32,64), NP (64 prompts a row), MAXT (128). Returns $OUT/batch_sweep_<stage>.tar.gz.
set -u
BATCHES=${BATCHES:-1,2,4,8,16,32,64}; NP=${NP:-64}; MAXT=${MAXT:-128}; export OUT
source tools/device/ab_lib.sh
if [ "${STAGE:-1}" = 1 ]; then
  stage_a batch_sweep1
  ROWS="python3 -m eyas.cli $L8B --batch-sizes $BATCHES --num-prompts $NP --max-tokens $MAXT"
  timeout 330 $ROWS --modes plain,chain:3 --out $R/l8b 2>&1 | grep "^| [pcm]"
  timeout 200 $ROWS --modes tree:smollm2_48d5 --out $R/l8b_tree 2>&1 | grep "^| [tm]"
else
  stage_b batch_sweep2
  timeout 540 python3 -m eyas.cli bench latency --model smollm2 --draft default --prompts $S/question.jsonl \
    --batch-sizes $BATCHES --num-prompts $NP --max-tokens $MAXT \
    --modes plain,chain:3,tree:8,tree:smollm2_25,tree:smollm2_48d5,dispatch:1=tree:smollm2_48d5,4=tree:8,256=chain:3 \
    --out $R/sm 2>&1 | grep "^| [pctdm]"
fi
(cd $R/.. && tar czf $OUT/batch_sweep_${STAGE:-1}.tar.gz $(basename $R))
