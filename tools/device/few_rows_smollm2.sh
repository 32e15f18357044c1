# Session 15: SmolLM2 with the few-rows path (eyas.models.one_row's tile and two-row kernels), after a call that
# copied .stage/a/part_aa to /root/stage (carry .stage/b). Batch 1 over all 80 MT-Bench first turns: plain,
# chain:3 and the default tree with the path, chain:3 without (`--no-few-rows`); then plain at batch 2 and 4 on 16
# prompts with and without. One archive back: $OUT/few_rows_smollm2.tar.gz.
source tools/device/stage_smollm2.sh
R=$W/few_rows; mkdir -p $R
LAT="python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens 128 --prompts $S/question.jsonl"
$LAT --modes ${MODES:-plain,chain:3,tree:smollm2_48d5} --batch-sizes 1 --num-prompts ${NP:-80} --out $R/on 2>&1 | grep "^| [pct]"
$LAT --modes ${MODES_OFF:-chain:3} --batch-sizes 1 --num-prompts ${NP:-80} --no-few-rows --out $R/off 2>&1 | grep "^| [pct]"
$LAT --modes plain --batch-sizes 2,4 --num-prompts 16 --out $R/b24_on 2>&1 | grep "^| [pct]"
$LAT --modes plain --batch-sizes 2,4 --num-prompts 16 --no-few-rows --out $R/b24_off 2>&1 | grep "^| [pct]"
[ -n "${GRAPH_TEST:-}" ] && timeout ${GRAPH_TEST_S:-200} python3 -m pytest -q tests/test_cuda_graph.py -k smollm2 \
  -p no:cacheprovider 2>&1 | tail -n 2
(cd $W && tar czf $OUT/few_rows_smollm2.tar.gz few_rows)
