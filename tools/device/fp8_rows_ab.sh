#!/usr/bin/env bash
# Issue #5 (session 44): a wide FP8 draft's levels of two tokens (the 8B shape's `chain:3` at batch 2) on the FP8 GEMV
# (on: `eyas.layers.linear_fp8.WIDE_ROW_KERNEL_MAX_ROWS` = 1, which `eyas.models.one_row.draft_rows_max` follows)
# against the register kernel at two rows (off: 2, main before it; session 44's call 12 set the draft levels' own
# constant, since folded into that one, to 2 as well). One call, no staging: the GPU tests of the rule
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
  if [ $v = off ]; then line="m.WIDE_ROW_KERNEL_MAX_ROWS = 2"
  else line="pass"; fi
  switch_run ${v}_$i eyas.layers.linear_fp8 "$line" $L8B --batch-sizes ${BATCHES:-2} --num-prompts ${NP:-24} \
    --max-tokens 128 --modes chain:3
done
echo "== rows [t=$(el)]"
latency_rows
echo "== end [t=$(el)]"
