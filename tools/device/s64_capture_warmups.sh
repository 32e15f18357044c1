# For session 64: does a decode graph need two eager warm-up steps before its capture (`CAPTURE_WARMUPS`), or one?
# Wheels only (carry .whl), one call of ~6-8 min on a fresh machine. For each setting (2, then 1, then 2 again: the
# first process compiles the kernels), python3 tools/diag/capture_time.py (the server's startup capture: the shipped
# dispatcher, 64 sequences, SmolLM2-shape) and, with 1, the graph tests that hold graphs to eager steps:
# pytest -n 4 tests/test_cuda_graph.py -k "not smollm2". Keep 1 only if the tests pass and the capture is shorter.
# FIRST_USE=1: first, tools/diag/first_use_stall.py on random weights of SmolLM2's shape (the first request asking for
# log-probabilities or penalties, whose graphs are captured in its path), with question.jsonl from .stage/c or $S.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
if [ -n "${FIRST_USE:-}" ]; then
  Q=$(ls .stage/*/question.jsonl /root/stage/question.jsonl 2>/dev/null | head -n 1)
  echo "== first use, random weights ($Q)"
  timeout ${FU_S:-150} python3 tools/diag/first_use_stall.py --shape smollm2-shape --prompts $Q --batch-sizes 1,4 \
    --max-tokens 64 --max-num-seqs 16 --out $OUT/first_use_shape.json 2>&1 | grep "^{" | cut -c1-400
fi
F=eyas/engine/cuda_graph.py
cp $F /tmp/cuda_graph.py.orig
for w in ${WS:-2 1 2}; do
  cp /tmp/cuda_graph.py.orig $F
  sed -i "s/^CAPTURE_WARMUPS = .*/CAPTURE_WARMUPS = $w/" $F
  grep -q "^CAPTURE_WARMUPS = $w$" $F || exit 1
  echo "== warm-ups $w"
  timeout ${CAP_S:-200} python3 tools/diag/capture_time.py 2>&1 | grep "^{" | tee -a $OUT/capture_warmups.jsonl
  if [ $w = 1 ] && [ -z "${SKIP_TESTS:-}" ]; then
    timeout ${TEST_S:-240} python3 -m pytest -q -n 4 --tb=short tests/test_cuda_graph.py -k "not smollm2" 2>&1 \
      | grep -v Warn | tail -n 6
  fi
done
cp /tmp/cuda_graph.py.orig $F
