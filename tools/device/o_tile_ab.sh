#!/usr/bin/env bash
# Issue #5, point 3 (session 44): the 8B shape's verify passes with their o projection on decode_linear's tile kernel
# (`eyas.models.llama.O_TILE_ROWS`: on) against cuBLAS's split-K GEMM (O_TILE_ROWS = 0: main before it). One call, no
# staging: the GPU tests of tests/test_o_tile.py, then `chain:3` at batch sizes BATCHES on the 8B shape with the
# recorded rank paths (ab_lib.sh's L8B), processes alternated (ORDER), then points 1 and 3 of record (POINTS), and
# each process's rows.
#   bash tools/device/o_tile_ab.sh        (ORDER "off on off on", NP prompts 40, BATCHES "1,4", TESTS 1, POINTS 1)
# Session 44 (docs/benchmarks.md, "Session 44"), with the tile from 2 rows: batch 1 (4 rows) 1.6% slower a step, 2 (8
# rows) 2.5% faster, 3 (12) 0.7%, 4 (16) 0.9%; since then O_TILE_MIN_ROWS = 8 (batch 1's chain stays on cuBLAS):
#   bash tools/device/o_tile_ab.sh                                              # call 7 (the rule from 2 rows)
#   TESTS=0 POINTS=0 BATCHES=2,3 ORDER="off on off on" NP=24 bash tools/device/o_tile_ab.sh   # call 8
set -u
source tools/device/ab_lib.sh
begin o_tile
gpu_tests 200 tests/test_o_tile.py
i=0
for v in ${ORDER:-off on off on}; do
  i=$((i + 1))
  echo "== $v [t=$(el)]"
  if [ $v = off ]; then line="m.O_TILE_ROWS = 0"; else line="pass"; fi
  switch_run ${v}_$i eyas.models.llama "$line" $L8B --batch-sizes ${BATCHES:-1,4} --num-prompts ${NP:-40} \
    --max-tokens 128 --modes chain:3
done
if [ "${POINTS:-1}" = 1 ]; then  # points 1 and 3 of record with the new default (ab_lib.sh's L8B, 40 x 128, --repeat 2)
  echo "== points [t=$(el)]"
  switch_run points eyas.models.llama pass $L8B --batch-sizes 1 --num-prompts 40 --max-tokens 128 --repeat 2 \
    --modes plain,chain:3
fi
echo "== rows [t=$(el)]"
latency_rows
echo "== end [t=$(el)]"
