# For the session after 34 (issue #5 point 2a): the one-launch attention for short contexts
# (tree_attention.ONE_PASS_TOKENS, off) in a 256-token context bucket, against the 256 bucket alone and main's
# buckets. Session 17 timed a first version of the kernel alone: 4.93 against 6.10 us a layer at 128 tokens; the
# benchmark's MT-Bench contexts are mostly under 256 tokens. No staging (smollm2-shape, run N A's bf16 rank paths):
# `fp8head` (also ready, not in the default variants): the draft's own FP8 copy of the head alone
# (`--draft-quant fp8-head`): its step time here, its TPC from `eyas bench tpc --draft-quant fp8-head`.
#   bash tools/device/one_pass_ab.sh   (TESTS=0 skips the GPU tests; ROUNDS=2; CONTEXTS="64 128";
#                                       VARIANTS="onepass b256 main", or with fp8head)
# The real model's point 2a then needs the three staging calls (tools/device/README.md) and
#   eyas bench latency --model smollm2 --modes plain,tree:smollm2_48d5 --batch-sizes 1 --num-prompts 80 ...
# with the switches of the variant that wins.
set -u
source tools/device/ab_lib.sh
begin one_pass   # eyas on the path, $OUT made, the clock (el)
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests [t=$(el)]"
  timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda_graph.py tests/test_fp8.py \
    -k "${TESTS_K:-one_pass or context_buckets or keys or fp8_draft_levels}" 2>&1 | tail -n 6
fi
for r in $(seq ${ROUNDS:-2}); do
  echo "== engine A/B round $r [t=$(el)]"
  for ctx in ${CONTEXTS:-64 128}; do
    for v in ${VARIANTS:-onepass b256 main}; do
      case $v in
        onepass) s2_run ${v}_c${ctx}_$r "cg.CONTEXT_BUCKETS = (256, 512, 2048); m.ONE_PASS_TOKENS = 257" --context $ctx ;;
        b256) s2_run ${v}_c${ctx}_$r "cg.CONTEXT_BUCKETS = (256, 512, 2048)" --context $ctx ;;
        main) s2_run ${v}_c${ctx}_$r "pass" --context $ctx ;;
        fp8head) s2_run ${v}_c${ctx}_$r "pass" --context $ctx --draft-quant fp8-head ;;
      esac
    done
  done
done
echo "== rows [t=$(el)]"
latency_rows
