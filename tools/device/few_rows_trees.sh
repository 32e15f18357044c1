# Session 35, for the next session (issue #5 point 2a): trees small enough for the few-rows verify pass.
# Ran in session 36 (call 3, 385 s): none beat the default tree on MT-Bench; docs/benchmarks.md, "Session 36".
# The verify pass takes the tile kernels with their fused epilogues up to FEW_ROWS_MAX (16) tokens and cuBLAS beyond;
# the default tree verifies 49 tokens on cuBLAS (0.821 of 1.178 ms a step in session 31's H200 profile). No tree
# fitted to the draft with at most 15 nodes (16 tokens with the root) was ever timed at batch 1 (session 17's refit
# tried 48-128 nodes). The
# candidates are `eyas make-tree` fits to the shipped draft on SmolLM2's float32 answers (CPU, session 35) to 199
# ShareGPT first turns that runs P and Q's data (.stage/d) did not answer: docs/bench/trees_s35/fit-*.json (the
# paths of one tree each; make_tree.json there has the commands and the TPC each replays on those answers).
# Calls: 1 (carry .stage/a) `mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/`, 2 (carry .stage/b)
# `cp .stage/b/part_ab /root/stage/`, 3 (carry .stage/c) `bash tools/device/few_rows_trees.sh`.
# Every candidate is timed on the real model beside plain decoding and the default tree (MT-Bench first turns,
# batch 1); the 24- and 31-node trees also with FEW_ROWS_MAX = 32 (their verify pass on the tile kernels).
# Choose by ms a step over the TPC replayed on the fit answers (not MT-Bench's), as session 17 did; MT-Bench's
# measured ratio is then the check. Env: TREES (docs/bench/trees_s35), NP (80), REPEAT (2), TESTS (1: the few-rows GPU
# tests first).
set -u
source tools/device/thirds_lib.sh
stage_thirds || exit 1
source tools/device/ab_lib.sh
TREES=${TREES:-docs/bench/trees_s35}; NP=${NP:-80}; REPEAT=${REPEAT:-2}
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests [t=$(el)]"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k "gpu_few_rows" 2>&1 | tail -n 2
fi
small=plain,tree:smollm2_48d5; wide=tree:smollm2_48d5
for f in $TREES/fit-*.json; do
  n=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))))" $f)
  if [ $n -le 15 ]; then small=$small,$f; else wide=$wide,$f; fi
done
# lat TAG LINE MODES: one process of `eyas bench latency` on the real model, LINE run first (eyas.models.one_row as m)
lat() {
  switch_run $1 eyas.models.one_row "$2" bench latency --model smollm2 --draft default --max-tokens 128 \
    --prompts $S/question.jsonl --batch-sizes 1 --num-prompts $NP --repeat $REPEAT --modes $3
  echo "$1 done [t=$(el)]"
}
lat small "pass" $small
lat wide16 "pass" $wide
lat wide32 "m.FEW_ROWS_MAX = 32" $wide
latency_rows
