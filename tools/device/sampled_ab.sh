# Session 58: sampled decoding's step with and without the vocabulary's sort (3ab6471: a step whose sampled requests
# ask for no filter takes the softmax alone). SmolLM2 with its shipped draft, MT-Bench's 80 first turns x 128 tokens,
# temperature 1: `--top-k 49152` keeps every token (the same distribution) but takes the filtered path, the sort that
# every sampled step took before 3ab6471. Then the greedy rows of point 2a on the same machine.
# Call 3 of three (calls 1 and 2 copied .stage/a/part_aa and .stage/b/part_ab to $S); carry .stage/c and .whl.
source tools/device/thirds_lib.sh
stage_thirds || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L="python3 -m eyas.cli bench latency --model smollm2 --draft default --prompts $S/question.jsonl --num-prompts 80
   --max-tokens 128 --batch-sizes ${BATCHES:-1,16} --repeat ${REPEAT:-2}"
for v in "sampled:--temperature 1" "filtered:--temperature 1 --top-k 49152" "greedy:"; do
  name=${v%%:*}; echo "== $name [t=$(el)]"
  $L --modes ${MODES:-plain,chain:3,tree:smollm2_48d5} ${v#*:} --out $W/$name > $W/$name.log 2>&1 || tail -n 5 $W/$name.log
  grep "^|\|^model" $W/$name.log; cp $W/$name/latency.json $OUT/$name.json 2>/dev/null
done
echo "done [t=$(el)]"
