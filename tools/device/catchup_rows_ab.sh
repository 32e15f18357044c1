#!/usr/bin/env bash
# Issue #5, point 3 (written in session 24, run in session 25: slower, not kept): a chain's catch-up level on the
# register kernel. The catch-up reads up to 4 tokens (padded to 4 at batch 1), so its FP8 linears take the FP8 GEMV
# with split-K reductions (Fp8Linear: ROW_KERNEL_MAX_ROWS = 2). This times them at 4 rows alone
# (tools/diag/draft_level_bench.py --rows 4), then the 8B shape's chain:3 at batch 1 (80 prompts x 128, the H200
# recording read evenly: ab_lib's L8B) in processes alternated with ROW_KERNEL_MAX_ROWS = 4 (on) and 2 (off, the
# default). No carry (no SmolLM2).
# Env: NP8B (80), MAXT (128), ORDER ("1 0 1 0").
set -u
NP8B=${NP8B:-80}; MAXT=${MAXT:-128}
source tools/device/ab_lib.sh
begin catchup
echo "== level bench, 4 rows [t=$(el)]"
timeout 150 python3 tools/diag/draft_level_bench.py --rows 4 --out $OUT/draft_level_rows4.json 2>&1 | grep -v "^ *$"
echo "== 8B chain:3, catch-up on the register kernel or not [t=$(el)]"
alternate rows4 "import eyas.layers.linear_fp8 as f
f.ROW_KERNEL_MAX_ROWS = 4 if on else 2" "^| [pc]" $R/l8b $L8B --batch-sizes 1 --num-prompts $NP8B \
  --max-tokens $MAXT --modes plain,chain:3 --repeat 1
(cd $R/.. && tar czf $OUT/catchup.tar.gz catchup)
echo "== end [t=$(el)]"
