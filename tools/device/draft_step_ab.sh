# Sessions 40-41 (issue #5 point 2a): four levers for the draft's side of a speculative step, timed against main on
# the real model in session 42. The prologue won there and is on since: its variant is now `noprologue` (off). The
# GEMV's PDL and the fused commit lost and were removed (their variants with them). rows8 lost in session 43 (the
# tree's step 1.076-1.079 ms against main's 1.043-1.052; call 3); its variant turns it on.
# - rows8: the register kernel up to 8 rows for FP8 linears (`eyas.layers.linear_fp8.ROW_KERNEL_MAX_ROWS = 8`, 2 on
#   main): the default tree's first level (8 rows) would take it, with its PDL and weights loaded before the wait.
#   Session 25 measured 4 rows on the 8B shape's draft slower there (K = 4096); SmolLM2's head has K = 576.
# - prologue: the step's index work around the catch-up in two Triton launches (`eyas.spec.step.FUSED_PROLOGUE`,
#   `eyas.kernels.spec_prologue`), where ~9 small PyTorch kernels ran (session 39's profile: ~10 us of them between
#   the catch-up and the root's head, which then could not load its weights early).
# Calls: 1 (carry .stage/a) `mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/`, 2 (carry .stage/b)
# `cp .stage/b/part_ab /root/stage/`, 3 (carry .stage/c) `bash tools/device/draft_step_ab.sh`: the GPU tests with
# rows8 and the prologue on, then the real model, MT-Bench 80 x 128, batch 1, `--repeat 1`, plain, `chain:3` and the
# default tree, processes in ORDER (main rows8 noprologue main rows8 noprologue; session 42's variants all, commit,
# prologue and gemvpdl are gone with what they switched) while under BUDGET (440) seconds. Send each call at once after the one
# before: the machine goes back after 30 s idle (session 40).
set -u
source tools/device/thirds_lib.sh
stage_thirds || exit 1
source tools/device/ab_lib.sh
rows8="m.ROW_KERNEL_MAX_ROWS = 8"
noprologue="import eyas.spec.step as st; st.FUSED_PROLOGUE = False"
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: the timings only
echo "== gpu tests with rows8 (and the prologue, the default) on [t=$(el)]"
timeout 200 python3 -c "
import sys, pytest, eyas.layers.linear_fp8 as m
$rows8
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_fp8.py', 'tests/test_gemv.py',
                      'tests/test_spec_prologue.py', '-k', 'gpu or prologue']))" 2>&1 | tail -n 2
fi
ORDER=${ORDER:-main rows8 noprologue main rows8 noprologue} \
  mtbench_ab eyas.layers.linear_fp8
echo "== end [t=$(el)]"
