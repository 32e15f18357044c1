# Session 60: the shipped temperature bands at T=1, where requests that never speculate now decode without the
# draft (the bare tree, e2fbdc3), against plain decoding; then top-p 0.9 at T=1 with the sort-free filters off and
# on (SORT_FREE_FILTERS by a sed: the search kernel at every row count). SKIP_BANDS=1 skips the bands. SmolLM2 with
# its shipped draft, MT-Bench's 80 first turns x 128 tokens, batches 1 and 16. Call 3 of three (calls 1 and 2
# copied .stage/a/part_aa and .stage/b/part_ab to $S); carry .stage/c and .whl.
source tools/device/thirds_lib.sh
stage_thirds || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD EYAS_SMOLLM2_GGUF=$S/smollm2.gguf
SPEC=$(python3 -c "import json; print(json.load(open('eyas/drafts/smollm2/config.json'))['eyas_speculation']['cuda'])")
L="python3 -m eyas.cli bench latency --model smollm2 --draft default --prompts $S/question.jsonl --num-prompts 80
   --max-tokens 128 --batch-sizes ${BATCHES:-1,16}"
bench() {  # NAME SECONDS ARGS...
  local name=$1 s=$2
  shift 2
  echo "== $name [t=$(el)]"
  timeout $s $L "$@" --out $W/$name > $W/$name.log 2>&1 || tail -n 5 $W/$name.log
  grep "^|" $W/$name.log; cp $W/$name/latency.json $OUT/$name.json 2>/dev/null
}
[ -n "${SKIP_BANDS:-}" ] || bench bands_t1 ${BANDS_S:-150} --temperature 1 --modes "plain,$SPEC"
for sf in False True; do
  sed -i "s/^SORT_FREE_FILTERS = .*/SORT_FREE_FILTERS = $sf/" eyas/spec/step.py
  grep -c "^SORT_FREE_FILTERS = $sf" eyas/spec/step.py > /dev/null || exit 1
  bench topp_sortfree_$sf ${TOPP_S:-150} --temperature 1 --top-p 0.9 --modes "plain,chain:3,tree:smollm2_48d5"
done
echo "done [t=$(el)]"
