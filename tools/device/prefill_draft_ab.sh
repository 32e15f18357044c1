# The prefill graphs' checks left by session 61, and DRAFT_IN_PREFILL (the draft's catch-up over the prompt inside the
# prefill's step and graph; off from fdff480, on since session 62 ran this) timed off and on. Wheels only (carry
# .whl), SmolLM2-shape random weights, one call of ~5 min:
#   1. the prefill graph tests and the graph tests without SmolLM2 (the shared output buffers; the draft's reading in
#      the graph == eager: tests/test_prefill_graph.py sets the switch itself);
#   2. the same graph tests with DRAFT_IN_PREFILL on (by a sed);
#   3. python3 tools/diag/prefill_cost.py --mode tree:smollm2_48d5 with it off, then on; plain once;
#   4. python3 tools/diag/capture_time.py (what eyas serve's start costs, the prefill graphs' part reported apart).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
F=eyas/engine/prefill_graph.py
tests() {
  timeout ${TEST_S:-150} python3 -m pytest -q -n 4 --tb=line tests/test_prefill_graph.py tests/test_cuda_graph.py \
    -k "not smollm2" 2>&1 | grep -v Warn | tail -n 6
}
echo "== tests, DRAFT_IN_PREFILL as shipped"; tests
for on in False True; do
  sed -i "s/^DRAFT_IN_PREFILL = .*/DRAFT_IN_PREFILL = $on/" $F
  grep -q "^DRAFT_IN_PREFILL = $on" $F || exit 1
  [ $on = True ] && { echo "== tests, DRAFT_IN_PREFILL on"; tests; }
  echo "== prefill_cost, tree, DRAFT_IN_PREFILL $on"
  timeout 120 python3 tools/diag/prefill_cost.py --mode tree:smollm2_48d5 --out $OUT/prefill_tree_$on.json 2>&1 \
    | grep "^{" | cut -c1-240
done
echo "== prefill_cost, plain"
timeout 120 python3 tools/diag/prefill_cost.py --mode plain --out $OUT/prefill_plain.json 2>&1 | grep "^{" | cut -c1-240
echo "== capture_time (DRAFT_IN_PREFILL on)"
timeout 200 python3 tools/diag/capture_time.py 2>&1 | tail -n 1 | tee $OUT/capture_time.json
