# Session 16: the target's RMSNorm weights folded into its projections (eyas.models.fused.fold_norms) on the H200,
# against `--no-fold-norms`. STAGE=1 (carry .stage/a): copies part_aa to /root/stage, runs the GPU tests of the
# fused kernels, then the 8B rows at 1k context with run L's rank paths (32k draft vocabulary + FP8 draft, issue
# #5 points 1 and 3). STAGE=2 (carry .stage/b, after stage 1): SmolLM2 over the 80 MT-Bench first turns (point 2a),
# folded / not folded / folded again, a profile of the folded tree step, the graphs test. Each stage returns one
# archive, $OUT/fold_norms_<stage>.tar.gz.
if [ "${STAGE:-1}" = 1 ]; then
  mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 R=/root/w/fold1; mkdir -p $R
  timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider tests/test_fused_ops.py tests/test_decode_linear.py \
    -k gpu 2>&1 | tail -n 3
  L8B="bench latency --model llama-3.1-8b-shape --context 1024 --max-tokens ${MAXT:-128} --draft-vocab 32768 \
    --draft-quant fp8 --accept-ranks docs/bench/ranks_smollm2_runL_dv32s_fp8_cpu.safetensors --batch-sizes 1"
  for run in on off on2; do
    f=; [ $run = off ] && f=--no-fold-norms
    python3 -m eyas.cli $L8B --num-prompts ${NP:-80} --modes ${MODES:-plain,chain:3} $f --out $R/l8b_$run 2>&1 \
      | grep "^| [pct]" | sed "s/^/$run /"
  done
  (cd /root/w && tar czf $OUT/fold_norms_1.tar.gz fold1)
else
  source tools/device/stage_smollm2.sh
  R=$W/fold2; mkdir -p $R
  LAT="python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens 128 --prompts $S/question.jsonl \
    --batch-sizes 1 --num-prompts ${NP:-80}"
  for run in on off on2; do
    f=; [ $run = off ] && f=--no-fold-norms
    $LAT --modes ${MODES:-plain,chain:3,tree:smollm2_48d5} $f --out $R/sm_$run 2>&1 | grep "^| [pct]" | sed "s/^/$run /"
  done
  python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens 64 --prompts $S/question.jsonl \
    --modes tree:smollm2_48d5 --batch-sizes 1 --num-prompts 2 --profile --out $R/prof > $R/profile.txt 2>&1
  grep "GPU kernels per step" $R/profile.txt
  [ -n "${GRAPH_TEST:-}" ] && timeout ${GRAPH_TEST_S:-200} python3 -m pytest -q tests/test_cuda_graph.py -k smollm2 \
    -p no:cacheprovider 2>&1 | tail -n 2
  (cd $W && tar czf $OUT/fold_norms_2.tar.gz fold2)
fi
