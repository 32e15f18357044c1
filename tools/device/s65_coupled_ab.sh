# Session 65: the sampled step's cost with coupled acceptance (`eyas.spec.step.COUPLED`, on since e77b517: a race over
# every node's row, then the greedy walk) against the multi-round rounds it replaced (COUPLED = False, set by a sed in
# this machine's copy), ABBA order; SmolLM2 with its shipped draft, MT-Bench's first turns, temperature 1 (and
# top-p 0.9 with TOPP=1). Call 3 of three (calls 1 and 2 copied .stage/a/part_aa and .stage/b/part_ab to $S); carry
# .stage/c and .whl.
source tools/device/thirds_lib.sh
stage_thirds || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
F=eyas/spec/step.py; cp $F /tmp/step.py.orig
L="python3 -m eyas.cli bench latency --model smollm2 --draft default --prompts $S/question.jsonl
   --num-prompts ${NP:-80} --max-tokens ${MT:-64} --batch-sizes ${BATCHES:-1,16} --temperature 1"
i=0
for name in ${NAMES:-coupled rounds rounds coupled}; do
  i=$((i+1)); cp /tmp/step.py.orig $F
  [ $name = rounds ] && sed -i 's/^COUPLED = True/COUPLED = False/' $F
  grep "^COUPLED = " $F
  echo "== $name $i [t=$(el)]"
  timeout ${LIMIT_S:-150} $L ${TOPP:+--top-p 0.9} --modes ${MODES:-plain,chain:3,tree:smollm2_48d5} \
    --out $W/$name$i > $W/$name$i.log 2>&1 || tail -n 5 $W/$name$i.log
  grep "^|" $W/$name$i.log; cp $W/$name$i/latency.json $OUT/${name}_$i.json 2>/dev/null
done
cp /tmp/step.py.orig $F
echo "done [t=$(el)]"
