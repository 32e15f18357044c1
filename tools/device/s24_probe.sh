#!/usr/bin/env bash
# Session 24 (issue #5, point 3): where the 8B `chain:3` step goes today, and SmolLM2's rank paths recorded on the
# H200 in bf16 (as session 12 recorded run L's) beside the CPU recording the 8B rows replay since session 13.
# STAGE=1 (carry .stage/a): the GGUF's first half staged; the 8B shape's plain and chain:3 steps profiled at batch 1
#   (kernel timelines to $OUT); one 8B draft level's linears: cuBLAS bf16, the Triton FP8 GEMV and torch._scaled_mm.
# STAGE=2 (carry .stage/b .stage/rk .stage/dv32, after stage 1): SmolLM2's greedy MT-Bench answers on the H200
#   (make-distill-data, 128 tokens, first turns), the shipped draft's rank paths over them (make-tree
#   --save-eval-ranks) in bf16 with (a) FP8 weights and the 32k draft vocabulary, as the 8B rows run, and (b) neither
#   (its replayed TPC against the engine's measured 2.485); then the 8B shape over all 80 prompts replaying (a) and
#   the CPU recording, processes alternated.
# Env: NP8B (80; 0: no 8B rows), MAXT (128), FT (the first turns answered: .stage/rk/first_turns.jsonl).
set -u
NP8B=${NP8B:-80}; MAXT=${MAXT:-128}; FT=${FT:-.stage/rk/first_turns.jsonl}; export OUT
source tools/device/ab_lib.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
L8B_BASE="bench latency --model llama-3.1-8b-shape --context 1024 --draft-vocab 32768 --draft-quant fp8"
if [ "${STAGE:-1}" = 1 ]; then
  stage_a probe
  echo "== profile [t=$(el)]"
  python3 -m eyas.cli $L8B --batch-sizes 1 --num-prompts 4 --max-tokens 32 --modes plain,chain:3 --profile \
    --out $R/prof > $R/prof.log 2>&1
  grep -E "GPU kernels per step|^\| [pc]" $R/prof.log
  cp $R/prof/kernels_*.tsv $OUT/ 2>/dev/null || find $R -name "kernels_*" -exec cp {} $OUT/ \;
  echo "== fp8 level [t=$(el)]"
  python3 tools/diag/gemv_fp8_bench.py --ms 1,4 --no-sweep --scaled-mm --out $OUT/fp8mm.json 2>&1 | grep -v "^ *$"
  gzip -c $R/prof.log > $OUT/prof.log.gz
  echo "== end [t=$(el)]"
else
  stage_b probe2
  D=$R/dvNa; mkdir -p $D
  cp eyas/drafts/smollm2/config.json eyas/drafts/smollm2/model.safetensors eyas/drafts/smollm2/training.json $D/
  cp .stage/dv32/draft_vocab.safetensors $D/
  echo "== answers [t=$(el)]"
  python3 -m eyas.cli make-distill-data --data $FT --out $R/mt_gpu.jsonl --max-tokens $MAXT \
    --max-turns 1 --draft default --no-progress 2>&1 | tail -n 2
  for v in "dv32s_fp8:$D:--draft-quant fp8" "bf16:default:"; do
    IFS=: read name draft q <<< "$v"
    echo "== ranks $name [t=$(el)]"
    python3 -m eyas.cli make-tree --model smollm2 --draft $draft $q --data $R/mt_gpu.jsonl --out $R/fit_$name.json \
      --nodes 48 --max-depth 5 --refit-rounds 0 --eval-data $R/mt_gpu.jsonl --compare chain:3 tree:smollm2_48d5 \
      --save-eval-ranks $OUT/ranks_smollm2_runNa_${name}_gpu.safetensors > $R/fit_$name.log 2>&1
    grep -A4 '"replayed_tpc"' $R/fit_$name.log
  done
  cp $R/mt_gpu.jsonl $OUT/
  i=0
  for f in $OUT/ranks_smollm2_runNa_dv32s_fp8_gpu.safetensors docs/bench/ranks_smollm2_runNa_dv32s_fp8_cpu.safetensors \
           $OUT/ranks_smollm2_runNa_dv32s_fp8_gpu.safetensors docs/bench/ranks_smollm2_runNa_dv32s_fp8_cpu.safetensors; do
    i=$((i + 1))
    [ $(el) -gt 470 ] || [ "$NP8B" = 0 ] && break
    echo "== $i: $(basename $f) [t=$(el)]"
    python3 -m eyas.cli $L8B_BASE --accept-ranks $f --batch-sizes 1 --num-prompts $NP8B --max-tokens $MAXT \
      --modes plain,chain:3 --repeat 1 --out $R/l8b_$i 2>&1 | grep "^| [pc]" | sed "s/^/$i /"
  done
  (cd $W && tar czf $OUT/probe2.tar.gz probe2/l8b_* probe2/fit_*)
  echo "== end [t=$(el)]"
fi
