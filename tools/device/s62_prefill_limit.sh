# Session 62's open question for a GPU: does the prefill graphs' larger limit (8,192 padded tokens, `graph_tokens`)
# pay above a billion parameters too? Wheels only (carry .whl), random weights of the 8B shape, one call of ~4-6 min.
# Prompts of 300 tokens in waves of 9 and 16: at the default limit (2,048 for the 8B shape) they prefill eagerly at
# their own shape; at 8,192 (SMALL_MODEL raised by a sed, so the 8B counts as small) from graphs padded to 16 x 320,
# which for 9 sequences is 1.9x the tokens. Batch 1 takes the same shapes at both limits (a control). Prints TTFT
# and TTIT a row; $OUT/limit_{default,8192}.json.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
F=eyas/engine/prefill_graph.py
cp $F /tmp/prefill_graph.py.orig
for limit in default 8192; do
  cp /tmp/prefill_graph.py.orig $F
  [ $limit = 8192 ] && { sed -i "s/^SMALL_MODEL = .*/SMALL_MODEL = 10**12/" $F; grep -q "^SMALL_MODEL = 10\*\*12" $F || exit 1; }
  echo "== limit $limit"
  timeout ${LIMIT_S:-240} python3 -m eyas.cli bench latency --model ${MODEL:-llama-3.1-8b-shape} --context ${CTX:-300} \
    --num-prompts 18 --max-tokens 8 --batch-sizes 1,9,16 --modes plain --out /tmp/limit_$limit > /tmp/limit_$limit.log 2>&1 \
    || tail -n 5 /tmp/limit_$limit.log
  python3 -c "import json,sys; [print(r['mode'], r['batch'], 'ttft_ms %.2f' % r['ttft_ms'], 'ttit_ms %.3f' % r['ttit_ms']) for r in json.load(open(sys.argv[1]))['results']]" /tmp/limit_$limit/latency.json
  cp /tmp/limit_$limit/latency.json $OUT/limit_$limit.json
done
cp /tmp/prefill_graph.py.orig $F
