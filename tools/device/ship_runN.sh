#!/usr/bin/env bash
# Session 23: everything docs/ records for run N's draft A, now in eyas/drafts/smollm2 (issue #4's presets, issue #5's
# points 2a and 3). Each stage prints its rows and returns $OUT/ship_<stage>.tar.gz.
# STAGE=1 (carry .stage/a): the 8B shape at 1k context (FP8 draft, 32k draft vocabulary), its rank paths replayed:
#   run N A's (docs/bench/ranks_smollm2_runNa_dv32s_fp8_cpu) and run L's, processes alternated N, L, N, L; plain,
#   chain:3 and the default tree at batches 1 and 32.
# STAGE=2 (carry .stage/b, after stage 1): eyas bench tpc with every preset at T=0 and 1 (MT-Bench, 128 tokens), then
#   SmolLM2 at batch 1 (plain, chain:3, the default tree; 40 prompts x 128, --repeat 3), then the SmolLM2 graph tests.
# Env: NP8B (16), NP (40), MAXT (128), REPEAT (3).
set -u
NP8B=${NP8B:-16}; NP=${NP:-40}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}; export OUT
source tools/device/ab_lib.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
if [ "${STAGE:-1}" = 1 ]; then
  stage_a ship1
  L8B_BASE="bench latency --model llama-3.1-8b-shape --context 1024 --draft-vocab 32768 --draft-quant fp8"
  i=0
  for run in Na L Na L; do
    i=$((i + 1))
    echo "== $i: run $run's paths [t=$(el)]"
    python3 -m eyas.cli $L8B_BASE --accept-ranks docs/bench/ranks_smollm2_run${run}_dv32s_fp8_cpu.safetensors \
      --batch-sizes 1,32 --num-prompts $NP8B --max-tokens $MAXT --modes plain,chain:3,tree:smollm2_48d5 \
      --repeat $REPEAT --out $R/l8b_${run}_$i 2>&1 | grep "^| [pct]" | sed "s/^/$i $run /"
  done
  (cd $R/.. && tar czf $OUT/ship_1.tar.gz ship1)
else
  stage_b ship2
  echo "== tpc, every preset at T=0 and 1 [t=$(el)]"
  python3 -m eyas.bench.tpc --model smollm2 --draft default --speculation chain:3 --speculation tree:smollm2_48d5 \
    --speculation tree:smollm2_128 --speculation tree:mc_sim_7b_63 --speculation tree:8 --speculation chain:5 \
    --speculation tree:16 --temperature 0 1 --max-tokens $MAXT --prompts $S/question.jsonl --out $R/tpc 2>&1 | grep "^|"
  echo "== SmolLM2, batch 1 [t=$(el)]"
  python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens $MAXT --prompts $S/question.jsonl \
    --batch-sizes 1 --num-prompts $NP --repeat $REPEAT --modes plain,chain:3,tree:smollm2_48d5 --out $R/sm 2>&1 \
    | grep "^| [pct]"
  echo "== graph tests [t=$(el)]"
  timeout $(( 570 - $(el) )) python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k smollm2 2>&1 \
    | tail -n 3 | tee $R/tests.txt
  (cd $W && tar czf $OUT/ship_2.tar.gz ship2)
  echo "== end [t=$(el)]"
fi
