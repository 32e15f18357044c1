# Session 39 (issue #5 points 2a and 5): the register kernel's small weights (SmolLM2's one-row linears) trigger the
# next PDL launch at "start" (main since this session) against "end" (before), on the real model: MT-Bench's 80 first
# turns x 128, batch 1, plain and the default tree, `--repeat 2`, processes in ORDER (main end main end); then point
# 5's graph tests (`tests/test_cuda_graph.py -k smollm2`) on main.
# Calls: 1 (carry .stage/a) `mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/`, 2 (carry .stage/b)
# `cp .stage/b/part_ab /root/stage/`, 3 (carry .stage/c) `bash tools/device/trigger_real.sh`.
# Ran in session 39 (call 10): plain 0.4124 / 0.4128 ms a token at "start" against 0.4705 / 0.4703 at "end".
set -u
source tools/device/thirds_lib.sh
stage_thirds || exit 1
source tools/device/ab_lib.sh
ORDER=${ORDER:-main end main end} main_vs end "$SMALL_END" bench latency --model smollm2 --draft default \
  --max-tokens 128 --prompts $S/question.jsonl --batch-sizes 1 --num-prompts ${NP:-80} --repeat ${REPEAT:-2} \
  --modes plain,tree:smollm2_48d5
latency_rows
(cd $OUT && tar czf rows.tar.gz *_[0-9]* && rm -rf *_[0-9]*)
if [ "${TESTS:-1}" = 1 ]; then
  echo "== point 5 [t=$(el)]"
  timeout $(( 590 - $(el) )) python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k smollm2 2>&1 | tail -n 3
fi
echo "== end [t=$(el)]"
