# Session 58: the sampled step's acceptance, every node's rounds at once (`accept_tree`) against the walk
# (`accept_tree_reference`, what every sampled step ran before), on SmolLM2 with its shipped draft, MT-Bench's 80
# first turns x 128 tokens at temperature 1 (no filter: the softmax alone). The walk runs after a sed makes the step
# call it in this machine's copy. Call 3 of three (calls 1 and 2 copied
# .stage/a/part_aa and .stage/b/part_ab to $S); carry .stage/c and .whl.
source tools/device/thirds_lib.sh
stage_thirds || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L="python3 -m eyas.cli bench latency --model smollm2 --draft default --prompts $S/question.jsonl --num-prompts 80
   --max-tokens 128 --batch-sizes ${BATCHES:-1,16} --repeat ${REPEAT:-1} --temperature 1"
for name in vectorised walk; do
  if [ $name = walk ]; then  # the step calls the walk instead
    sed -i 's/accept_tree(probs, node_tokens, tree, inp.seeds, n, use_triton)/accept_tree_reference(probs, node_tokens, tree, inp.seeds, n)/; s/^from eyas.spec.verifier import accept_tree, /from eyas.spec.verifier import accept_tree_reference, accept_tree, /' eyas/spec/step.py
    grep -c "accept_tree_reference(probs" eyas/spec/step.py || exit 1
  fi
  echo "== $name [t=$(el)]"
  $L --modes ${MODES:-plain,chain:3,tree:smollm2_48d5} --out $W/$name > $W/$name.log 2>&1 || tail -n 5 $W/$name.log
  grep "^|\|^model" $W/$name.log; cp $W/$name/latency.json $OUT/accept_$name.json 2>/dev/null
done
echo "done [t=$(el)]"
