# Session 33: where the splits' partials are large (tree_attention.SKIP_EMPTY_BYTES), splits without keys store no o
# and the reduction reads only the seen partials (`skip`, the default), against every split storing its o and the
# reduction reading them all (`all`: SKIP_EMPTY_SPLITS = False). A graph fixes the split count by the block table's
# width, which a server sizes by max_model_len (SmolLM2: 8192), so short contexts leave most splits empty. One call,
# no staging (smollm2-shape, run N A's bf16 rank paths replayed):
#   bash tools/device/empty_splits_ab.sh     (TESTS=0 skips the GPU tests; BENCH=0 the kernels alone; ROUNDS=2;
#                                             WIDE=8192 the engine's --max-model-len for the wide rows)
set -u
source tools/device/ab_lib.sh
begin empty_splits   # eyas on the path, $OUT made, the clock (el)
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests [t=$(el)]"
  timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "${TESTS_K:-prefix or split or keys or gpu}" 2>&1 | tail -n 4
fi
if [ "${BENCH:-1}" = 1 ]; then
  echo "== kernels alone [t=$(el)]"
  timeout 150 python3 tools/diag/empty_splits_bench.py --out $OUT/kernels.json 2>&1 | tail -n 20
fi
AB() {  # tag, SKIP_EMPTY_SPLITS, bench latency arguments...
  local tag=$1 on=$2; shift 2
  switch_run $tag eyas.kernels.tree_attention "m.SKIP_EMPTY_SPLITS = $on" bench latency --model smollm2-shape \
    --context 128 --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors "$@"
}
for r in $(seq ${ROUNDS:-2}); do
  echo "== engine A/B round $r [t=$(el)]"
  for v in ${ORDER:-skip all}; do
    on=$([ $v = skip ] && echo True || echo False)
    AB ${v}_wide_$r $on --batch-sizes 1 --num-prompts 8 --max-tokens 64 --modes plain,tree:smollm2_48d5 \
      --max-model-len ${WIDE:-8192}
    AB ${v}_tight_$r $on --batch-sizes 1 --num-prompts 8 --max-tokens 64 --modes plain,tree:smollm2_48d5
  done
done
echo "== rows [t=$(el)]"
latency_rows
