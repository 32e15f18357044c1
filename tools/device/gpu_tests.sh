#!/usr/bin/env bash
# The whole test suite on the H200, with SmolLM2 staged: the tests that pick the GPU where there is one (graphs,
# kernels, overlap, the real model's greedy equality with graphs) run there, and those marked `interpreted_only`
# skip (tests/helpers.py). No recent session has run it whole (session 47's call 8 ran two files and found a test
# that had never run on a GPU). The device's Python lacks fastapi, uvicorn and openai: tests/test_server.py is left
# out (its engine work is the same on the CPU). After the staging calls of tools/device/README.md (part_aa, part_ab
# copied to /root/stage); carry .stage/c:
#
#   GROUP=gpu bash tools/device/gpu_tests.sh    # the files that use CUDA where it is there
#   GROUP=rest bash tools/device/gpu_tests.sh   # the others
#
# Each group runs under TESTS_S seconds (540) with XDIST workers (4); JUnit XML and the log land in $OUT.
set -u
source tools/device/thirds_lib.sh
stage_thirds || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
GPU_FILES=$(grep -l cuda tests/test_*.py | tr '\n' ' ')
REST_FILES=$(for f in tests/test_*.py; do grep -q cuda $f || echo -n "$f "; done)
case ${GROUP:-gpu} in
  gpu) FILES=$GPU_FILES ;;
  rest) FILES=${REST_FILES//tests\/test_server.py/} ;;
  *) echo "GROUP: gpu | rest"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
echo "== pytest ${GROUP:-gpu}: $FILES [t=$(el)]"
set -o pipefail
timeout ${TESTS_S:-540} python3 -m pytest -q -p no:cacheprovider -n ${XDIST:-4} --durations=10 -rfE \
  --junitxml=$OUT/junit_${GROUP:-gpu}.xml $FILES 2>&1 | tee $OUT/pytest_${GROUP:-gpu}.log | tail -n 40
echo "== end rc=$? [t=$(el)]"
