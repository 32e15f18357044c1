# What session 62 wrote after its last device call, on a GPU: wheels only (carry .whl), one call of ~4 min.
#   1. the prefill graph tests and the graph tests without SmolLM2: graph_tokens (5ead0d5), the logits and the first
#      tokens inside the prefill's step and graph (d04738f, a893630: the replay test compares them to the eager
#      step's, to the bit), the
#      failed capture's fallback (001629a; on the CPU only: nothing makes a capture fail on purpose), the inputs'
#      pinned staging (fc6de03: the replay test's three chunks go through it);
#   2. python3 tools/diag/prefill_cost.py, plain and the default tree (SmolLM2-shape random weights): TTFT with the
#      logits and the first tokens in the graph, against session 62's call 1 (docs/benchmarks.md, "Session 62":
#      plain 1.83-3.33 ms, the tree 1.76-3.58 ms; the logits and first-token phases 0.20-0.36 and 0.18-0.34 ms then).
# Then, with SmolLM2 staged: pytest -p no:xdist tests/test_cuda_graph.py -k smollm2; and bash
# tools/device/s62_prefill_limit.sh (the 8B shape's prefill at both limits).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
echo "== tests"
timeout ${TEST_S:-200} python3 -m pytest -q -n 4 --tb=short tests/test_prefill_graph.py tests/test_cuda_graph.py \
  -k "not smollm2" 2>&1 | grep -v Warn | tail -n 12
for m in plain tree:smollm2_48d5; do
  echo "== prefill_cost $m"
  timeout 120 python3 tools/diag/prefill_cost.py --mode $m --out $OUT/prefill_${m%%:*}.json 2>&1 | grep "^{" | cut -c1-240
done
