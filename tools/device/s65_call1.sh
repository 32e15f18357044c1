# Session 65, call 1 of three (carry .whl .stage/a; wheels only, no SmolLM2): the graph tests with coupled acceptance
# on (`eyas.spec.step.COUPLED`, the default since e77b517: the sampled, temperature-band and log-probability graph
# tests had not run on a GPU with it), then the startup capture with and without `--capture-extras logprobs`
# (tools/diag/capture_time.py; the first process compiles, so plain runs twice: before and after).
mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
grep -n "^COUPLED = " eyas/spec/step.py
echo "== graph tests, -n ${N:-3} [t=$(el)]"
timeout ${TEST_S:-300} python3 -m pytest -q -n ${N:-3} --tb=short tests/test_cuda_graph.py -k "not smollm2" 2>&1 \
  | grep -v Warn | tail -n 12
for x in none logprobs none; do
  echo "== capture extras $x [t=$(el)]"
  e=""; [ $x != none ] && e="--capture-extras $x"
  timeout ${CAP_S:-120} python3 tools/diag/capture_time.py $e 2>&1 | grep "^{" | tee -a $OUT/capture_extras.jsonl
done
echo "done [t=$(el)]"
