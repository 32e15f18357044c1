#!/usr/bin/env bash
# Everything docs/ records for a draft about to ship, on one GPU, in ~6.5 minutes (session 11's call 4): `eyas bench tpc`
# with every preset at T=0 and 1 on MT-Bench, its rank paths (eyas make-tree --save-eval-ranks; carry .stage/s8), the
# 8B-shape rows replayed at those paths, and SmolLM2 at batch 1 over the 80 prompts. DRAFT: a directory, or `default`
# (the working tree's eyas/drafts/smollm2). Call 2 or later of tools/device/README.md. One file comes back:
# $OUT/measure.tar.gz (tpc/, ranks_mtbench.safetensors, l8b/, smollm2/).
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
source tools/device/stage_smollm2.sh > /dev/null 2>&1
[ -n "${STAGED:-}" ] || [ -f $S/smollm2.gguf ] || { echo "staging failed"; exit 1; }
DRAFT=${DRAFT:-default}; R=$W/measure; mkdir -p $R
echo "== tpc, every preset at T=0 and 1 [t=$(el)]"
python3 -m eyas.bench.tpc --model smollm2 --draft $DRAFT --speculation chain:3 --speculation tree:smollm2_48d5 \
  --speculation tree:smollm2_128 --speculation tree:mc_sim_7b_63 --speculation tree:8 --speculation chain:5 \
  --speculation tree:16 --temperature 0 1 --max-tokens ${MAX_TOK:-128} --prompts $S/question.jsonl ${TPC_EXTRA:-} \
  --out $R/tpc 2>&1 | grep "^|"
echo "== rank paths on MT-Bench [t=$(el)]"
python3 -m eyas.spec.tree_builder --model smollm2 --draft $DRAFT --data .stage/s8/answers.jsonl.gz \
  --out $R/fit.json --nodes 48 --max-depth 5 --refit-rounds 0 --eval-data .stage/s8/mt.jsonl \
  --compare chain:3 tree:smollm2_48d5 --save-eval-ranks $R/ranks_mtbench.safetensors 2>&1 | tail -n 6
echo "== 8B shape at those paths [t=$(el)]"
python3 -m eyas.cli bench latency --model llama-3.1-8b-shape --modes plain,chain:3,tree:smollm2_48d5 \
  --batch-sizes 1,32 --context 1024 --max-tokens 64 --num-prompts 32 --accept-ranks $R/ranks_mtbench.safetensors \
  --out $R/l8b 2>&1 | grep "^|"
echo "== SmolLM2, batch 1, the 80 prompts [t=$(el)]"
python3 -m eyas.cli bench latency --model smollm2 --draft $DRAFT \
  --modes plain,chain:3,tree:smollm2_48d5,tree:smollm2_128 --batch-sizes 1 --num-prompts 80 --max-tokens 128 \
  --prompts $S/question.jsonl --out $R/smollm2 2>&1 | grep "^|"
(cd $W && tar czf $OUT/measure.tar.gz measure)
echo "== end [t=$(el)]"
