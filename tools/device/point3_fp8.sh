#!/usr/bin/env bash
# Issue #5 point 3 (session 13's last call; no SmolLM2 needed): the 8B-shape rows replayed over as many prompts and
# tokens as SmolLM2's MT-Bench profile was recorded on (80 x 128), with the whole 128k head (bf16 draft, the H200
# recording), then with a 32k draft vocabulary, bf16 and FP8 drafts, each replaying rank paths recorded with its own
# draft on the CPU (ShareGPT's 32k most frequent tokens, `eyas make-draft-vocab`); then session 12's shape of row
# (32 prompts x 64 tokens) for comparison. Everything lands in $OUT.
#   bash tools/device/point3_fp8.sh                  # on the GPU machine, from the repository root
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=docs/bench
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv,noheader
L="python3 -m eyas.cli bench latency --model llama-3.1-8b-shape --context 1024"
M=chain:3,tree:smollm2_48d5
row() { local name=$1; shift; echo "== $name [t=$(el)]"; timeout ${ROW_S:-200} $L "$@" --out $OUT/$name 2>&1 | grep "^|"; }
row full --num-prompts 80 --max-tokens 128 --modes plain,$M --batch-sizes 1,32 \
  --accept-ranks $R/ranks_smollm2_runL_mtbench.safetensors
row dv_bf16 --num-prompts 80 --max-tokens 128 --modes $M --batch-sizes 1,32 --draft-vocab 32768 \
  --accept-ranks $R/ranks_smollm2_runL_dv32s_cpu.safetensors
row dv_fp8 --num-prompts 80 --max-tokens 128 --modes $M --batch-sizes 1,32 --draft-vocab 32768 --draft-quant fp8 \
  --accept-ranks $R/ranks_smollm2_runL_dv32s_fp8_cpu.safetensors
row np32 --num-prompts 32 --max-tokens 64 --modes plain,chain:3 --batch-sizes 1 --draft-vocab 32768 --draft-quant fp8 \
  --accept-ranks $R/ranks_smollm2_runL_dv32s_fp8_cpu.safetensors
echo "== end [t=$(el)]"
cd $OUT && tar czf rows.tgz */ && rm -rf */ ; ls $OUT
