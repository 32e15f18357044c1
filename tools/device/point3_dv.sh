#!/usr/bin/env bash
# Issue #5 point 3 at batch 1 with a draft vocabulary (session 13; no SmolLM2 needed): the 8B-shape rows at run L's
# rank paths, with the whole 128k head and with a 32k draft vocabulary (EAGLE-3's size for Llama 3), whose acceptance
# is replayed from SmolLM2's own 16k and 32k draft-vocabulary rank paths (a bracket: -2.2% and -0.3% of `chain:3` TPC
# on MT-Bench). The batch-1 rows are repeated over 160 prompts: a replay of 32 prompts x 64 tokens reads 32 runs of
# the recording, and its TPC moves by ~0.07 with the prompts drawn. Then a profile of the `chain:3` step.
#   bash tools/device/point3_dv.sh                  # on the GPU machine, from the repository root
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=docs/bench
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv,noheader
L="python3 -m eyas.cli bench latency --model llama-3.1-8b-shape --context 1024 --max-tokens 64"
M="chain:3,tree:smollm2_48d5"
row() { local name=$1; shift; echo "== $name [t=$(el)]"; timeout ${ROW_S:-150} $L "$@" --out $OUT/$name 2>&1 | grep "^|"; }
row full32 --num-prompts 32 --modes plain,$M --batch-sizes 1,32 --accept-ranks $R/ranks_smollm2_runL_mtbench.safetensors
row dv32k --num-prompts 32 --modes $M --batch-sizes 1,32 --draft-vocab 32768 \
  --accept-ranks $R/ranks_smollm2_runL_dv32k_cpu.safetensors
row dv16k --num-prompts 32 --modes $M --batch-sizes 1,32 --draft-vocab 32768 \
  --accept-ranks $R/ranks_smollm2_runL_dv16k_cpu.safetensors
row cpu32 --num-prompts 32 --modes $M --batch-sizes 1,32 --accept-ranks $R/ranks_smollm2_runL_cpu.safetensors
row np160 --num-prompts 160 --modes plain,chain:3 --batch-sizes 1 --accept-ranks $R/ranks_smollm2_runL_mtbench.safetensors
row np160dv --num-prompts 160 --modes chain:3 --batch-sizes 1 --draft-vocab 32768 \
  --accept-ranks $R/ranks_smollm2_runL_dv32k_cpu.safetensors
echo "== profile [t=$(el)]"
timeout 120 $L --num-prompts 2 --modes plain,chain:3 --batch-sizes 1 --draft-vocab 32768 --profile \
  --accept-ranks $R/ranks_smollm2_runL_dv32k_cpu.safetensors --out /tmp/prof > $OUT/profile.log 2>&1
echo "== end [t=$(el)]"
cd $OUT && tar czf rows.tgz */ && rm -rf */ ; ls $OUT
