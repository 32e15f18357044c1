#!/usr/bin/env bash
# Call 3 of tools/device/README.md: wait for the draft training, then measure TPC on MT-Bench (all presets, T=0 and 1) and SmolLM2 latency.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
S=/root/stage; W=/root/w; mkdir -p $OUT
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD EYAS_SMOLLM2_GGUF=$S/smollm2.gguf TOKENIZERS_PARALLELISM=true
while [ ! -f $W/train.done ] && [ $(el) -lt ${WAIT_S:-360} ]; do sleep 5; done
echo "== training done? $(ls $W/train.done 2>/dev/null) [t=$(el)]"
grep -a "eval step" $W/train.log | tail -n 5; tail -c 1500 $W/train.log
cp $W/t1/model.safetensors $W/t1/config.json $OUT/ 2>/dev/null   # training.json travels in train_logs (8 files at most)
(cd $W && tar czf $OUT/train_logs.tar.gz t1/metrics.jsonl t1/training.json train.log probe/training.json 2>/dev/null)
D=$W/t1; [ -f $D/model.safetensors ] || D=default
echo "== graphs == eager, SmolLM2 on the GPU [t=$(el)]"
timeout ${GRAPH_TEST_S:-75} python3 -m pytest -q tests/test_cuda_graph.py -p no:cacheprovider 2>&1 | tail -n 3
echo "== tpc [t=$(el)]"
timeout $(( 500 - $(el) )) python3 -m eyas.bench.tpc --model smollm2 --draft $D --speculation chain:3 \
  --speculation tree:mc_sim_7b_63 --speculation tree:16 --speculation tree:8 --speculation chain:5 --temperature 0 1 \
  --max-tokens 128 --prompts $S/question.jsonl --out $W/tpc 2>&1 | grep -v '^\s*$' | tail -n 16
cp $W/tpc/tpc.json $W/tpc/tpc.md $W/tpc/acceptance.png $OUT/ 2>/dev/null
echo "== latency [t=$(el)]"
timeout $(( 565 - $(el) )) python3 -m eyas.cli bench latency --model smollm2 --draft $D \
  --modes plain,chain:3,tree:8,tree:mc_sim_7b_63 --batch-sizes 1,4 --max-tokens 128 --prompts $S/question.jsonl \
  --out $W/lat 2>&1 | grep -v '^\s*$' | tail -n 14
(cd $W && tar czf $OUT/lat.tar.gz lat 2>/dev/null)
echo "== HF peers [t=$(el)]"
timeout $(( 595 - $(el) )) python3 -m eyas.cli bench peers --model smollm2 --prompts $S/question.jsonl --num-prompts 3 \
  --max-tokens 128 --peers hf-eager,hf-prompt-lookup --out $W/peers 2>&1 | grep -v '^\s*$' | tail -n 4
cp $W/peers/peers.json $OUT/ 2>/dev/null
echo "== end [t=$(el)]"
