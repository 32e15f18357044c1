# Session 37: the whole-K tile for launches of 2-16 rows (decode_linear.WHOLE_K_ROWS = 16, the new default) against
# main's K loop (WHOLE_K_ROWS = 0) on the real model, MT-Bench first turns at batch 1, processes alternated, then
# point 5's graph test with the new default.
# Calls: 1 (carry .stage/a) `mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/`, 2 (carry .stage/b)
# `cp .stage/b/part_ab /root/stage/`, 3 (carry .stage/c) `bash tools/device/whole_k_real.sh`.
# Env: NP (80), REPEAT (2), ORDER ("16 0 16 0"), TESTS (1). An ORDER token is WHOLE_K_ROWS for that process, or
# "w64": WHOLE_K_ROWS = 64 and one_row.FEW_ROWS_MAX = 64 (the default tree's 49-row verify pass on the whole-K tiles,
# the over-16-rows rule's configs; session 38: ORDER="16 w64 w64 16").
set -u
source tools/device/thirds_lib.sh
stage_thirds || exit 1
source tools/device/ab_lib.sh
NP=${NP:-80}; REPEAT=${REPEAT:-2}
i=0
for wk in ${ORDER:-16 0 16 0}; do
  i=$((i + 1))
  if [ $wk = w64 ]; then line="m.WHOLE_K_ROWS = 64; import eyas.models.one_row as o; o.FEW_ROWS_MAX = 64"
  else line="m.WHOLE_K_ROWS = $wk"; fi
  switch_run wk${wk}_$i eyas.kernels.decode_linear "$line" bench latency --model smollm2 \
    --draft default --max-tokens 128 --prompts $S/question.jsonl --batch-sizes 1 --num-prompts $NP --repeat $REPEAT \
    --modes ${MODES:-plain,chain:3,tree:smollm2_48d5}
  echo "wk${wk}_$i done [t=$(el)]"
done
latency_rows
if [ "${TESTS:-1}" = 1 ]; then
  echo "== graph tests [t=$(el)]"
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k smollm2 2>&1 | tail -n 2  # ~160 s
fi
