# Session 21 (issue #5, point 3): the FP8 GEMV's codes read as 32-bit words and widened by integer shifts and masks
# (`GemvConfig.words`, `eyas.kernels.gemv.FP8_WORDS`), against the conversion instructions they replace (the
# float16-sum path, session 13). No staging (random weights of the 8B shape).
# STAGE=1: tests/test_fp8.py on the GPU, then tools/diag/gemv_fp8_bench.py at one row over an 8B draft level's
#   shapes, the float16-sum configs with and without words (--sweep half).
# STAGE=2: the 8B shape's plain and chain:3 (FP8 draft, 32k draft vocabulary, run L's replayed rank paths), 1k
#   context, FP8_WORDS on / off alternated between processes (ORDER), NP8B x MAXT, --repeat REPEAT.
# Returns $OUT/fp8_words_<stage>.tar.gz.
set -u
NP8B=${NP8B:-16}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}; export OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=${W:-/root/w}/fp8_words${STAGE:-1}; mkdir -p $R $OUT
if [ "${STAGE:-1}" = 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py 2>&1 | tail -3 | tee $R/tests.txt
  python3 tools/diag/gemv_fp8_bench.py --ms 1 --sweep half --out $R/fp8_words_bench.json 2>&1 \
    | grep -v "^    " | tee $R/bench.txt
else
  RUN='import sys, eyas.kernels.gemv as g; g.FP8_WORDS = bool(int(sys.argv.pop(1))); from eyas.cli import main; sys.argv = ["eyas"] + sys.argv[1:]; main()'
  i=0
  for on in ${ORDER:-1 0 1 0}; do
    i=$((i + 1))
    python3 -c "$RUN" $on bench latency --model llama-3.1-8b-shape --context 1024 --draft-vocab 32768 \
      --draft-quant fp8 --accept-ranks docs/bench/ranks_smollm2_runL_dv32s_fp8_cpu.safetensors --batch-sizes 1 \
      --num-prompts $NP8B --max-tokens $MAXT --modes plain,chain:3 --repeat $REPEAT --out $R/l8b_$i 2>&1 \
      | grep "^| [pc]" | sed "s/^/$i words=$on /"
  done
fi
(cd $R/.. && tar czf $OUT/fp8_words_${STAGE:-1}.tar.gz fp8_words${STAGE:-1})
