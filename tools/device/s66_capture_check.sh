# Carry .whl (and .stage/a, to stage the GGUF's first third on the way; session 66: 199 s for ROUNDS=2 on a fresh H100).
# Session 67's answer: yes (collector off: 17 of 17 runs passed; the control failed 2 of 5).
# Does `eyas.engine.cuda_graph.capturing`
# (01ac5ed: the cycle collector off during every capture) end the overlapped test's invalidated captures (sessions 62
# and 65: `test_overlapped_graphs_equal_sequential_graphs`, under pytest-xdist only)? The graph files at -n 4, ROUNDS
# (3) times, each failure's first lines kept (session 65's call 13 lost a ValueError's message: --tb=line). Then,
# with the collector left on in this machine's copy (a sed), the same ROUNDS as the control.
# Session 66's lesson: a late machine leaves little budget, so the first GGUF third rides along (carry .stage/a too)
if [ -f .stage/a/part_aa ]; then mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/ && echo "staged part_aa"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
F=eyas/engine/cuda_graph.py; cp $F /tmp/cuda_graph.py.orig
for variant in ${VARIANTS:-off on}; do
  cp /tmp/cuda_graph.py.orig $F
  if [ $variant = on ]; then  # the control: the collector stays on through captures
    sed -i 's/^            gc.disable()$/            pass  # control: collector on/' $F
    grep -c "control: collector on" $F || exit 1
  fi
  for r in $(seq ${ROUNDS:-3}); do
    echo "== collector $variant during captures, round $r [t=$(el)]"
    timeout ${TEST_S:-150} python3 -m pytest -q -n 4 --tb=line tests/test_cuda_graph.py \
      tests/test_prefill_graph.py -k "not smollm2" 2>&1 | grep -v Warn | grep "Error\|error\|FAILED\|passed\|failed" \
      | cut -c1-300 | tail -n 12
  done
done
cp /tmp/cuda_graph.py.orig $F
echo "done [t=$(el)]"
