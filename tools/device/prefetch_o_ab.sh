#!/usr/bin/env bash
# Issue #5, points 1 and 3 (session 45): the attention before a wide model's o projection asks L2 for that
# projection's weight (`eyas.models.llama.PREFETCH_O_BYTES`, `eyas.kernels.prefetch`) against no prefetch
# (PREFETCH_O_BYTES = 0: main before it). One call, no staging: the GPU tests of tests/test_prefetch.py and the
# attention kernels', then plain decoding and `chain:3` at batch 1 on the 8B shape with the recorded rank paths
# (ab_lib.sh's L8B), processes alternated (ORDER), and each process's rows.
#   bash tools/device/prefetch_o_ab.sh        (ORDER "on off on off", NP prompts 16, MODES "plain,chain:3", TESTS 1)
set -u
source tools/device/ab_lib.sh
begin prefetch_o
gpu_tests 240 tests/test_prefetch.py tests/test_kernels.py -k "gpu or prefetch or lines"
i=0
for v in ${ORDER:-on off on off}; do
  i=$((i + 1))
  echo "== $v [t=$(el)]"
  if [ $v = off ]; then line="m.PREFETCH_O_BYTES = 0"; else line="pass"; fi
  switch_run ${v}_$i eyas.models.llama "$line" $L8B --batch-sizes 1 --num-prompts ${NP:-16} --max-tokens 128 \
    --modes ${MODES:-plain,chain:3}
done
echo "== rows [t=$(el)]"
latency_rows
echo "== end [t=$(el)]"
