#!/usr/bin/env bash
# Session 24 (issue #5, point 3): an FP8 draft's one-row levels on the register kernel (decode_linear with scale=,
# PDL: `eyas.models.one_row.forward_draft_rows` for levels of 1-2 tokens of a large draft, and Fp8Linear at 1-2 rows,
# its head among them), against the FP8 GEMV path they replace. No carry (no SmolLM2).
# 1. GPU tests: the FP8 register kernel at the 8B draft's shapes, the FP8 linear's kernels, the replay kernel.
# 2. tools/diag/draft_level_bench.py: one 8B draft level's linears, FP8 GEMV against the register kernel's configs.
# 3. The 8B shape, 80 prompts x 128, batch 1, plain and chain:3, SmolLM2's rank paths recorded on the H200
#    (docs/bench/ranks_smollm2_runNa_dv32s_fp8_gpu, read evenly), processes alternated: the rows path on / off
#    (off: `LARGE_DRAFT_ROWS_MAX = 0`, `ROW_KERNEL_MAX_ROWS = 0`, today's path).
# Env: NP8B (80), MAXT (128), ORDER ("1 0 1 0"), RANKS.
set -u
NP8B=${NP8B:-80}; MAXT=${MAXT:-128}; export OUT
RANKS=${RANKS:-docs/bench/ranks_smollm2_runNa_dv32s_fp8_gpu.safetensors}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=${W:-/root/w}/rows; mkdir -p $R $OUT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
echo "== tests [t=$(el)]"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py tests/test_fp8.py tests/test_verifier.py \
  -k "fp8 or draft_levels or large_drafts or replay or gpu_one_row or gpu_few_rows" 2>&1 | tail -n 4 | tee $R/tests.txt
echo "== level bench [t=$(el)]"
timeout 150 python3 tools/diag/draft_level_bench.py --out $OUT/draft_level.json 2>&1 | grep -v "^ *$" | tee $R/level.txt
L8B="bench latency --model llama-3.1-8b-shape --context 1024 --draft-vocab 32768 --draft-quant fp8"
SET="import eyas.layers.linear_fp8 as f, eyas.models.one_row as o
f.ROW_KERNEL_MAX_ROWS = 2 if on else 0
o.LARGE_DRAFT_ROWS_MAX = 2 if on else 0"
RUN="import sys
on = bool(int(sys.argv.pop(1)))
$SET
from eyas.cli import main
sys.argv = ['eyas'] + sys.argv[1:]
main()"
i=0
for v in ${ORDER:-1 0 1 0}; do
  i=$((i + 1))
  [ $(el) -gt 470 ] && break
  echo "== $i: rows=$v [t=$(el)]"
  python3 -c "$RUN" $v $L8B --accept-ranks $RANKS --batch-sizes 1 --num-prompts $NP8B --max-tokens $MAXT \
    --modes plain,chain:3 --repeat 1 --out $R/l8b_$i 2>&1 | grep "^| [pc]" | sed "s/^/$i rows=$v /"
done
(cd $R/.. && tar czf $OUT/rows.tar.gz rows)
echo "== end [t=$(el)]"
