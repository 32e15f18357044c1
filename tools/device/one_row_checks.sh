# Session 14: the one-row decode step (eyas.models.one_row) on the H200. No SmolLM2 needed.
# GPU tests of decode_linear / decode_qkv_rope / the one-row path; then the 8B rows at batch 1 (1k context): plain,
# and chain:3 with run L's rank paths under the 32k draft vocabulary + FP8 draft (issue #5 point 3); then the plain
# row with the path switched off (`--no-one-row`: the fused path as before) on NP_FUSED prompts. Call 10 of session 14
# ran it with a monkeypatch in place of the flag (added after the calls), to the same effect.
export PYTHONPATH=$PWD
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k gpu 2>&1 | tail -3
L8B="bench latency --model llama-3.1-8b-shape --context 1024 --max-tokens ${MAXT:-128} --batch-sizes 1"
python3 -m eyas.cli $L8B --num-prompts ${NP:-80} --draft-vocab 32768 --modes plain,chain:3 --draft-quant fp8 \
  --accept-ranks docs/bench/ranks_smollm2_runL_dv32s_fp8_cpu.safetensors --out $OUT/one_row 2>&1 | grep "^| [pc]"
python3 -m eyas.cli $L8B --num-prompts ${NP_FUSED:-16} --modes plain --no-one-row --out $OUT/fused 2>&1 | \
  grep "^| plain"
