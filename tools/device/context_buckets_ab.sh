# Session 34 (issue #5, servers): graphs per context bucket (eyas.engine.cuda_graph.CONTEXT_BUCKETS: each step graph
# also per bucket of 512 / 2048 tokens / the table's width, so a chat's context gets the split count of its bucket,
# not of max_model_len) against one graph for the width (`CONTEXT_BUCKETS = ()`, as before), and the benchmark's
# tight width. No staging (smollm2-shape, run N A's bf16 rank paths):
#   bash tools/device/context_buckets_ab.sh   (TESTS=0 skips the GPU tests; BENCH=0 the kernels alone; ROUNDS=2;
#                                              VARIANTS="buck nob tight"; CONTEXTS="128 1024")
# (Session 34's call 7 ran it with two more variants the code no longer has: session 33's skip, `nobseen`, and the
# skip without the suffix first in the kernel bench.)
set -u
source tools/device/ab_lib.sh
begin context_buckets   # eyas on the path, $OUT made, the clock (el)
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests [t=$(el)]"
  timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_kernels.py \
    -k "${TESTS_K:-(not smollm2 and not kernels) or keys or split_bound}" 2>&1 | tail -n 6
fi
if [ "${BENCH:-1}" = 1 ]; then
  echo "== kernels alone [t=$(el)]"
  timeout ${BENCH_S:-150} python3 tools/diag/empty_splits_bench.py --widths 8256 --contexts 150,1500,7000 \
    --variants ${KVARIANTS:-all,skip,skip_sf} --out $OUT/kernels.json 2>&1 | tail -n 8
fi
for r in $(seq ${ROUNDS:-2}); do
  echo "== engine A/B round $r [t=$(el)]"
  for ctx in ${CONTEXTS:-128 1024}; do
    for v in ${VARIANTS:-buck nob tight}; do
      case $v in
        buck) s2_run ${v}_c${ctx}_$r "pass" --context $ctx --max-model-len 8192 ;;
        nob) s2_run ${v}_c${ctx}_$r "cg.CONTEXT_BUCKETS = ()" --context $ctx --max-model-len 8192 ;;
        tight) s2_run ${v}_c${ctx}_$r "pass" --context $ctx ;;
      esac
    done
  done
done
echo "== rows [t=$(el)]"
latency_rows
