# Session 39 (issue #5 point 2a): trees of 64 verified tokens. Since session 38 a verify pass of up to 64 rows takes
# the whole-K tiles, in blocks of 32 rows (16-row tiles; SwiGLU's in 64-row ones), and the attention takes its query
# rows in 64-row tiles: 49 and 64 rows launch the same grids. Session 36's CPU count on the shipped draft's MT-Bench
# rank paths gave the best 64-node tree +2.7% over the default's expected TPC. So a 63-node tree may buy TPC for
# little step time.
# The candidates are fitted here, never to MT-Bench: `eyas make-tree` on SmolLM2's greedy bf16 answers (on the H200)
# to 320 ShareGPT first turns (.stage/c/fit_prompts.jsonl.gz: shard 03's first turns of 20-2000 characters, shuffled
# with random.Random(39); the shipped draft trained on ShareGPT first turns, so the fits may run deep, as session 36
# saw). Then every fit, the default tree and the dynamic trees of 48 and 63 tokens are timed on the real model,
# MT-Bench's 80 first turns x 128, batch 1, `--repeat 2`, in one process with plain decoding.
# Calls: 1 (carry .stage/a) `mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/`, 2 (carry .stage/b)
# `cp .stage/b/part_ab /root/stage/`, 3 (carry .stage/c) `bash tools/device/tree64.sh`; 4 (carry .stage/c, the
# machine warm) `TESTS=1 FIT=0 bash tools/device/tree64.sh`: point 5's graph tests.
# Env: FIT (1: answer, fit and time), TESTS (0: `tests/test_cuda_graph.py -k smollm2`), NP (80), REPEAT (2),
# ANS_BUDGET (90 s), MODES_EXTRA (more modes, comma-separated).
# Ran in session 39 (calls 4-5): no fit beat the default tree; docs/benchmarks.md, "Session 39".
set -u
source tools/device/thirds_lib.sh
stage_thirds || exit 1
source tools/device/ab_lib.sh
NP=${NP:-80}; REPEAT=${REPEAT:-2}; F=$W/fit64; mkdir -p $F
if [ "${FIT:-1}" = 1 ]; then
  echo "== answers [t=$(el)]"
  [ -f $F/ans.jsonl.gz ] || python3 -m eyas.cli make-distill-data --model smollm2 --data $C/fit_prompts.jsonl.gz \
    --out $F/ans.jsonl.gz --max-tokens 192 --batch-size 80 --max-turns 1 --max-prompt-tokens 1024 --draft default \
    --speculation chain:3 --time-budget ${ANS_BUDGET:-90} --no-progress 2>&1 | tail -n 1
  echo "== fit [t=$(el)]"
  [ -f $F/fit-63d5.json ] || timeout 200 python3 -m eyas.cli make-tree --model smollm2 --draft default \
    --data $F/ans.jsonl.gz --out $F/fit.json --nodes 48 63 --max-depth 5 6 --max-rank 10 --min-count 3 \
    --refit-rounds 3 --compare tree:smollm2_48d5 > $F/fit.log 2>&1
  grep -E "replayed|expected|nodes|^\{|tree" $F/fit.log | tail -n 30
  echo "== bench [t=$(el)]"
  modes=plain,tree:smollm2_48d5
  for t in 48d5 48d6 63d5 63d6; do [ -f $F/fit-$t.json ] && modes=$modes,$F/fit-$t.json; done
  modes=$modes,dyn:k8d6n48,dyn:k8d6n63${MODES_EXTRA:+,$MODES_EXTRA}
  switch_run t64 eyas.models.one_row "pass" bench latency --model smollm2 --draft default --max-tokens 128 \
    --prompts $S/question.jsonl --batch-sizes 1 --num-prompts $NP --repeat $REPEAT --modes $modes
  latency_rows
  (cd $W && tar czf $OUT/fit64.tar.gz fit64/fit* fit64/ans.jsonl.gz)
fi
if [ "${TESTS:-0}" = 1 ]; then
  echo "== point 5 [t=$(el)]"
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k smollm2 2>&1 | tail -n 3
fi
echo "== end [t=$(el)]"
