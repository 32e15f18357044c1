# Session 39, for session 40 (issue #5 point 2a): two levers for the draft's side of a speculative step, written
# without device time, timed against main on the real model in session 40 (then off on main; on since: the variants
# below now turn them off, so `main` has both and `both` has neither).
# - pdl: programmatic dependent launch for the draft level's small kernels between its head and its fc, the two
#   top-k passes (`eyas.kernels.chunk_topk.PDL`) and `draft_pairs` (`eyas.kernels.draft_pairs.PDL`). Session 39's
#   profile of the default tree's step showed a ~0.4 us gap before each, and the fc after draft_pairs could load its
#   weights while the pairs are built.
# - catchup: the draft's catch-up on the few-rows tile kernels through a stash and one commit launch
#   (`eyas.spec.drafter.CATCHUP_ROWS`), where it takes the fused path (session 39's profile: 38 us from its pairs to
#   its down projection's end, a tree level's 29-31 us on the tiles).
# Calls: 1 (carry .stage/a) `mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/`, 2 (carry .stage/b)
# `cp .stage/b/part_ab /root/stage/`, 3 (carry .stage/c) `bash tools/device/pdl_small_ab.sh`: the GPU tests with
# both off (session 40, at b0ce370: both on), then the real model, MT-Bench 80 x 128, batch 1, `--repeat 1`, plain,
# `chain:3` and the default tree, processes in ORDER (main pdl catchup both both catchup pdl main) while under
# BUDGET (440) seconds. Point 5's graph tests with both off: TESTS5=1 in a call of their own (~240-320 s). A CPU dry
# run (STAGED=1, PATH with the venv, OUT, W and S=a folder holding question.jsonl, NP=1, ORDER=both) needs
# TRITON_INTERPRET=1: the switches import the kernels before the tests could set it (session 39: the pdl variant's
# dry run, 45 passed, then the three modes on one prompt).
set -u
source tools/device/thirds_lib.sh
stage_thirds || exit 1
source tools/device/ab_lib.sh
pdl="import eyas.kernels.draft_pairs as dp; m.PDL = False; dp.PDL = False"
catchup="import eyas.spec.drafter as dr; dr.CATCHUP_ROWS = False"
both="$pdl; $catchup"
if [ "${TESTS5:-0}" = 1 ]; then
  echo "== point 5 with the switches off [t=$(el)]"
  timeout 560 python3 -c "
import sys, pytest, eyas.kernels.chunk_topk as m
$both
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_cuda_graph.py', '-k', 'smollm2']))" 2>&1 | tail -n 2
  exit 0
fi
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: the timings only
echo "== gpu tests with the switches off [t=$(el)]"
timeout 240 python3 -c "
import sys, pytest, eyas.kernels.chunk_topk as m
$both
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_topk.py', 'tests/test_fused_ops.py',
                      'tests/test_dynamic_tree.py', 'tests/test_decode_linear.py', '-k',
                      'not sm90 and (not decode_linear or gpu_few_rows or catch_up_on_the_rows)']))" 2>&1 | tail -n 2
fi
ORDER=${ORDER:-main pdl catchup both both catchup pdl main} mtbench_ab eyas.kernels.chunk_topk
echo "== end [t=$(el)]"
