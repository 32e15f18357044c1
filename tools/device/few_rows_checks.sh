# Session 15: the tile kernels (eyas.kernels.decode_linear, 2-64 rows) and the few-rows path (eyas.models.one_row)
# on the H200. No SmolLM2 needed. STAGE=1: synthetic chains (tools/diag/tile_chain_bench.py) and the GPU tests;
# STAGE=2: the 8B rows at 1k context with run L's rank paths (32k draft vocabulary + FP8 draft, issue #5 point 3),
# few rows on, then off (`--no-few-rows`).
export PYTHONPATH=$PWD
if [ "${STAGE:-1}" = 1 ]; then
  python3 tools/diag/tile_chain_bench.py --shape 8b --rows 4 --per-kind --out $OUT/tile_8b_m4.json \
    --configs ${CFG4:-16x256x4x4,32x256x4x4,16x128x4x4,32x128x4x4,16x512x4x3,64x128x4x3,16x256x8x4} 2>&1 | grep -v "^{'shape'.*max_abs" | cut -c1-400
  python3 tools/diag/tile_chain_bench.py --shape 8b --rows 32,49 --out $OUT/tile_8b_m32.json 2>&1 | cut -c1-300
  python3 tools/diag/tile_chain_bench.py --shape smollm2 --rows 49,4 --per-kind --out $OUT/tile_sm.json \
    --configs ${CFG49:-16x64x4x3,32x64x4x3,32x32x4x4,32x64x8x3,16x128x8x3,64x64x4x3,16x256x4x4} 2>&1 | cut -c1-400
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k gpu 2>&1 | tail -4
else
  L8B="bench latency --model llama-3.1-8b-shape --context 1024 --max-tokens ${MAXT:-128} --draft-vocab 32768 \
    --draft-quant fp8 --accept-ranks docs/bench/ranks_smollm2_runL_dv32s_fp8_cpu.safetensors"
  python3 -m eyas.cli $L8B --num-prompts ${NP:-80} --batch-sizes 1 --modes ${MODES:-plain,chain:3,tree:smollm2_48d5} \
    --out $OUT/few_on 2>&1 | grep "^| [pct]"
  python3 -m eyas.cli $L8B --num-prompts ${NP:-80} --batch-sizes 1 --modes ${MODES_OFF:-chain:3} --no-few-rows \
    --out $OUT/few_off 2>&1 | grep "^| [pct]"
  [ -n "$B32" ] && python3 -m eyas.cli $L8B --num-prompts 32 --max-tokens 64 --batch-sizes 32 --modes plain,chain:3 \
    --out $OUT/b32_on 2>&1 | grep "^| [pc]" && python3 -m eyas.cli $L8B --num-prompts 32 --max-tokens 64 \
    --batch-sizes 32 --modes plain --no-few-rows --out $OUT/b32_off 2>&1 | grep "^| [pc]"
fi
