# Session 59: a sampled step's acceptance from the logits (`accept_tree_logits`: row statistics, the children's
# probabilities and a race for the bonus; the default for steps without top-k/top-p/min-p) against session 58's
# `accept_tree` on the softmax's [B, N+1, V] probabilities (a sed makes the step take it in this machine's copy), with
# the rounds fused in one launch (`fused`: FUSED_SAMPLED_ROUNDS set by a sed), and greedy decoding for scale (NAMES
# picks among logits, greedy, fused, probs, in that order); SmolLM2 with its shipped draft, MT-Bench's 80 first
# turns x 128 tokens. Call 3 of three (calls 1 and 2 copied .stage/a/part_aa and .stage/b/part_ab to $S); carry
# .stage/c and .whl.
source tools/device/thirds_lib.sh
stage_thirds || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
L="python3 -m eyas.cli bench latency --model smollm2 --draft default --prompts $S/question.jsonl --num-prompts 80
   --max-tokens 128 --batch-sizes ${BATCHES:-1,16} --repeat ${REPEAT:-1}"
for name in ${NAMES:-logits greedy fused probs}; do
  if [ $name = fused ]; then  # the rounds and walk in one launch (eyas/kernels/accept_sampled.py)
    sed -i 's/^FUSED_SAMPLED_ROUNDS = False/FUSED_SAMPLED_ROUNDS = True/' eyas/spec/step.py
    grep -c "^FUSED_SAMPLED_ROUNDS = True" eyas/spec/step.py || exit 1
  fi
  if [ $name = probs ]; then  # the step accepts on the softmax's probabilities instead
    sed -i 's/^FUSED_SAMPLED_ROUNDS = True/FUSED_SAMPLED_ROUNDS = False/' eyas/spec/step.py
    sed -i 's/^    elif not filters:  # sampled:/    elif False:  # sampled:/' eyas/spec/step.py
    grep -c "elif False:  # sampled:" eyas/spec/step.py || exit 1
  fi
  T=1; [ $name = greedy ] && T=0
  echo "== $name (temperature $T) [t=$(el)]"
  timeout ${LIMIT_S:-200} $L --temperature $T --modes ${MODES:-plain,chain:3,tree:8,tree:smollm2_48d5} --out $W/$name \
    > $W/$name.log 2>&1 || tail -n 5 $W/$name.log
  grep "^|\|^model" $W/$name.log; cp $W/$name/latency.json $OUT/accept_$name.json 2>/dev/null
done
echo "done [t=$(el)]"
