# Session 61: what session 60 left to run on a GPU with SmolLM2 staged. Call 3 of three (calls 1 and 2 copied
# .stage/a/part_aa and .stage/b/part_ab to $S); carry .stage/c and .whl. .stage/c/old holds `git archive OLD eyas`
# without eyas/drafts (copied here): calls 3-4, ad3f9a3 (the code before 2fc3dc8, whose prefill drew the first token
# by softmax, sort and inverse CDF); call 9, cf604ae (the code before the prefill graphs).
# 1. pytest -p no:xdist tests/test_cuda_graph.py -k smollm2 (graphs == eager on the real model) unless SKIP_TESTS=1;
# 2. TTFT (each process runs from its code's root: `python -m` puts the working directory first on sys.path)
# 2. TTFT of greedy, T=1 and T=1 top-p 0.9 requests (TEMPS, '|' between them; MODES, default plain; batches 1
#    and 16, 80 x 16 tokens), ROUNDS of processes alternated: the old code and this checkout's (new).
source tools/device/thirds_lib.sh
stage_thirds || exit 1
[ -d .stage/c/old/eyas/drafts ] || cp -r eyas/drafts .stage/c/old/eyas/  # not carried (the size limit); unchanged since
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export EYAS_SMOLLM2_GGUF=$S/smollm2.gguf
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== graph tests [t=$(el)]"
  PYTHONPATH=/tmp/site:$PWD timeout ${TEST_S:-330} python3 -m pytest -q -p no:xdist tests/test_cuda_graph.py -k smollm2 \
    2>&1 | tail -n 4
fi
for round in ${ROUNDS:-1 2}; do
  for code in old new; do
    root=$PWD; [ $code = old ] && root=$PWD/.stage/c/old
    (cd $root && PYTHONPATH=/tmp/site:$root python3 -c "import eyas; print('eyas from', eyas.__file__)")
    IFS='|' read -ra TS <<< "${TEMPS:-0|1|1 --top-p 0.9}"
    for t in "${TS[@]}"; do
      name=ttft_${code}_r${round}_t${t// /}; name=${name//--top-p/_p}
      echo "== $name [t=$(el)]"
      (cd $root && PYTHONPATH=/tmp/site:$root timeout ${TTFT_S:-60} python3 -m eyas.cli bench latency --model smollm2 \
        --draft default --prompts $S/question.jsonl --num-prompts ${NP:-80} --max-tokens 16 --batch-sizes 1,16 \
        --modes ${MODES:-plain} --temperature $t ${DEV:-} --out $W/$name > $W/$name.log 2>&1) || tail -n 3 $W/$name.log
      python3 -c "import json,sys; [print(r['mode'], r['batch'], 'ttft_ms %.3f' % r['ttft_ms'], 'ttit_ms %.4f' % r['ttit_ms']) for r in json.load(open(sys.argv[1]))['results']]" $W/$name/latency.json 2>&1 | tail -n 8
      cp $W/$name/latency.json $OUT/$name.json 2>/dev/null
    done
  done
done
echo "done [t=$(el)]"
