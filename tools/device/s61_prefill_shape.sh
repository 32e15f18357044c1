# Session 61, call 10 (carry .whl .stage/c; .stage/c/old = git archive cf604ae eyas, without eyas/drafts): the
# prefill graphs' GPU tests, then TTFT on random SmolLM2-shape weights (prompts of 128 and 1024 tokens, plain and the
# default tree, batches 1 and 16), the code before the prefill graphs (old) against this checkout (new). In call 10
# the old processes failed (no eyas/drafts under .stage/c/old: the copy below came after); call 11 ran them alone.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
[ -d .stage/c/old/eyas/drafts ] || cp -r eyas/drafts .stage/c/old/eyas/  # not carried (the size limit); unchanged
timeout 120 python3 -m pytest -q -n 4 --tb=line tests/test_prefill_graph.py tests/test_cuda_graph.py -k "prefill or (graphs_equal_eager and not smollm2 and not guided and not ngram)" 2>&1 | grep -v Warn | tail -n 4
for ctx in 128 1024; do for code in old new; do
  root=$PWD; [ $code = old ] && root=$PWD/.stage/c/old
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 60 python3 -m eyas.cli bench latency --model smollm2-shape --context $ctx \
    --num-prompts 16 --max-tokens 16 --batch-sizes 1,16 --modes plain,tree:smollm2_48d5 --out /tmp/b_${code}_$ctx > /tmp/b_${code}_$ctx.log 2>&1) || tail -n 3 /tmp/b_${code}_$ctx.log
  echo "== $code ctx $ctx"; python3 -c "import json,sys; [print(r['mode'], r['batch'], 'ttft_ms %.3f' % r['ttft_ms'], 'ttit_ms %.4f' % r['ttit_ms']) for r in json.load(open(sys.argv[1]))['results']]" /tmp/b_${code}_$ctx/latency.json
  cp /tmp/b_${code}_$ctx/latency.json $OUT/shape_${code}_$ctx.json
done; done
