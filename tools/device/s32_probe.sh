# Session 32 (issue #5, point 2a): what programmatic dependent launch into the 49-row verify pass's GEMMs could give.
# One call, no staging (smollm2-shape, run N A's bf16 rank paths replayed):
#   1. tools/diag/cublas_pdl_probe.py: the race (RACE=1: do cuBLAS's kernels wait for the kernel before them?), then
#      a synthetic 30-layer verify pass: cuBLAS as the engine runs it, cuBLAS with programmatic edges (not exact: an
#      upper bound), decode_linear's tile kernels with PDL over CONFIGS;
#   2. the GPU test that PDL on the fused path changes no token (now with the SwiGLU launch's PDL);
#   3. AB=1: the engine, SwiGLU's PDL (llama.SWIGLU_PDL) on and off, processes alternated (ORDER). The switch is in
#      docs/experiments/swiglu_pdl_s32.patch (not on main: it did not pay); apply the patch first.
set -u
source tools/device/ab_lib.sh
begin s32
echo "== probe [t=$(el)]"
timeout 300 python3 tools/diag/cublas_pdl_probe.py --race ${RACE:-0} ${CONFIGS:+--configs $CONFIGS} --json $OUT/probe.json \
  2>&1 | grep -v '"nodes"' | cut -c1-400
if [ "${TESTS:-1}" = 1 ]; then
  echo "== tests [t=$(el)]"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k "gpu_fused_path_pdl" 2>&1 | tail -n 3
fi
if [ "${AB:-0}" = 1 ]; then
  echo "== swiglu pdl A/B [t=$(el)]"
  alternate swiglu_pdl 'import eyas.models.llama as m; m.SWIGLU_PDL = on' "^| [pt]" $R/ab bench latency \
    --model smollm2-shape --context 128 --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors \
    --batch-sizes 1 --num-prompts 8 --max-tokens 64 --modes tree:smollm2_48d5
fi
echo "== done [t=$(el)]"
