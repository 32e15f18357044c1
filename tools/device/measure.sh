#!/usr/bin/env bash
# Call 3 of tools/device/README.md: wait for the draft training(s), then measure TPC on MT-Bench (TPC_SPECS presets,
# TPC_TEMPS temperatures; every draft trained, layers-N of multi-draft runs included) and SmolLM2 latency with the draft
# of the best chain:3 TPC. At most 8 files come back: the best draft travels as a tar in 6 MB parts.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
S=${S:-/root/stage}; W=${W:-/root/w}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=true
[ -f $S/smollm2.gguf ] && export EYAS_SMOLLM2_GGUF=$S/smollm2.gguf
B=$([ -f $W/train2.log ] && echo 1 || echo 0)
done_all() { [ -f $W/train.done ] && { [ $B = 0 ] || [ -f $W/train2.done ]; }; }
while ! done_all && [ $(el) -lt ${WAIT_S:-360} ]; do sleep 5; done
echo "== training done? $(ls $W/train*.done 2>/dev/null | tr '\n' ' ') [t=$(el)]"
for L in $W/train.log $W/train2.log; do [ -f $L ] && { echo "-- $L"; grep -a "eval step" $L | tail -n 4; tail -c 900 $L; }; done
DRAFTS=""
for t in t1 t2; do
  # a run of one draft writes t/, of several t/layers-N/
  DS=$(cd $W && ls $t/model.safetensors $t/layers-*/model.safetensors 2>/dev/null | xargs -r -n1 dirname)
  for d in $DS; do DRAFTS="$DRAFTS $W/$d"; done
done
(cd $W && tar czf $OUT/train_logs.tar.gz t1/metrics.jsonl t2/metrics.jsonl t1/training.json t2/training.json train.log \
  train2.log probe/training.json 2>/dev/null)
DRAFTS=${DRAFTS:-default}
echo "== graphs == eager on the GPU with SmolLM2 (the other graphs tests ran in call 1) [t=$(el)]"
timeout ${GRAPH_TEST_S:-90} python3 -m pytest -q tests/test_cuda_graph.py -k smollm2 -p no:cacheprovider 2>&1 | tail -n 3
echo "== tpc: $DRAFTS [t=$(el)]"
SPECS=${TPC_SPECS:-chain:3 tree:mc_sim_7b_63 tree:16 tree:8 chain:5}
timeout $(( ${TPC_END_S:-500} - $(el) )) python3 -m eyas.bench.tpc --model smollm2 --draft $DRAFTS \
  $(for x in $SPECS; do echo --speculation $x; done) --temperature ${TPC_TEMPS:-0 1} \
  --max-tokens 128 --prompts $S/question.jsonl --out $W/tpc 2>&1 | grep -v '^\s*$' | tail -n 40
(cd $W && tar czf $OUT/tpc.tar.gz tpc 2>/dev/null)
# latency with the draft of the highest chain:3 TPC at T=0 (the shipped one if none came out)
D=$(python3 - <<PY 2>/dev/null || echo default
import glob, json
rows = [r for f in glob.glob("$W/tpc/*.json") for r in json.load(open(f)).get("results", [])
        if r["speculation"] == "chain:3" and r["temperature"] == 0]
print(max(rows, key=lambda r: r["tpc"])["draft"])
PY
)
echo "== best draft by chain:3 at T=0: $D"
# only the best draft comes back ($OUT returns at most 8 files, each up to a size limit that a 28 MB tar exceeded):
# a tar in 6 MB parts, joined with `cat best_draft.tar.part* > best_draft.tar`
[ "$D" != default ] && (cd $(dirname $D) && tar cf - $(basename $D)/model.safetensors $(basename $D)/config.json \
  $(basename $D)/training.json | split -b 6M -d - $OUT/best_draft.tar.part)
echo "== latency [t=$(el)]"
timeout $(( 565 - $(el) )) python3 -m eyas.cli bench latency --model smollm2 --draft $D \
  --modes plain,chain:3,tree:8,tree:mc_sim_7b_63 --batch-sizes 1,4 --num-prompts 8 --max-tokens 128 \
  --prompts $S/question.jsonl --out $W/lat 2>&1 | grep -v '^\s*$' | tail -n 14
(cd $W && tar czf $OUT/lat.tar.gz lat 2>/dev/null)
echo "== HF peers [t=$(el)]"
timeout $(( 595 - $(el) )) python3 -m eyas.cli bench peers --model smollm2 --prompts $S/question.jsonl --num-prompts 3 \
  --max-tokens 128 --peers hf-eager,hf-prompt-lookup --out $W/peers 2>&1 | grep -v '^\s*$' | tail -n 4
cp $W/peers/peers.json $OUT/ 2>/dev/null
echo "== end [t=$(el)]"
