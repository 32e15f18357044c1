#!/usr/bin/env bash
# Issue #5 (session 44): a wide FP8 draft's levels of two tokens (the 8B shape's `chain:3` at batch 2) on the FP8 GEMV
# (on: `eyas.layers.linear_fp8.WIDE_ROW_KERNEL_MAX_ROWS` = `eyas.models.one_row.LARGE_FP8_DRAFT_ROWS_MAX` = 1) against
# the register kernel at two rows (off: both 2, main before it). One call, no staging: the GPU tests of the rule
# (TESTS), then processes alternated (ORDER) at BATCHES on the 8B shape (ab_lib.sh's L8B, NP prompts x 128).
#   bash tools/device/fp8_rows_ab.sh      (ORDER "off on off on", BATCHES 2, NP 24, TESTS 1)
set -u
source tools/device/ab_lib.sh
begin fp8_rows
gpu_tests 90 tests/test_fp8.py -k "wide or by_rows"
i=0
for v in ${ORDER:-off on off on}; do
  i=$((i + 1))
  echo "== $v [t=$(el)]"
  if [ $v = off ]; then line="import eyas.layers.linear_fp8 as f; f.WIDE_ROW_KERNEL_MAX_ROWS = 2; m.LARGE_FP8_DRAFT_ROWS_MAX = 2"
  else line="pass"; fi
  switch_run ${v}_$i eyas.models.one_row "$line" $L8B --batch-sizes ${BATCHES:-2} --num-prompts ${NP:-24} \
    --max-tokens 128 --modes chain:3
done
echo "== rows [t=$(el)]"
latency_rows
echo "== end [t=$(el)]"
