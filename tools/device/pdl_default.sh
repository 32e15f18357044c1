# Session 20, after the attention kernels' PDL became the default (eyas.kernels.tree_attention.PDL = True): the GPU
# tests that hold graphs and the row paths to their references with it on, then the rows of record.
# STAGE=1 (carry .stage/a; copies part_aa to /root/stage for stage 2): the tiny models' graph tests, the PDL plumbing
#   test, the acceptance kernels on the GPU (tests/test_verifier.py: the replay's launch since 63544f9), then the
#   8B shape at 1k context, plain and chain:3, NP8B x 128, --repeat 3.
# STAGE=2 (carry .stage/b, after stage 1): the SmolLM2 graph tests (point 5), SmolLM2 over NP MT-Bench first turns:
#   plain, chain:3, the default tree; then the default tree with its 49-row verify pass on the tile kernels
#   (`eyas.models.one_row.FEW_ROWS_MAX = 64`, set from the command line) against cuBLAS (main), alternated.
# Prints the tests' summaries and the rows; returns $OUT/pdl_default_<stage>.tar.gz.
set -u
NP8B=${NP8B:-40}; NP=${NP:-80}; NPT=${NPT:-40}; MAXT=${MAXT:-128}; export OUT
source tools/device/ab_lib.sh
if [ "${STAGE:-1}" = 1 ]; then
  stage_a pdl1
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k "not smollm2" 2>&1 | tail -3 \
    | tee $R/graph_tests.txt
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k "pdl_is_asked" 2>&1 | tail -3 \
    | tee $R/pdl_test.txt
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_verifier.py 2>&1 | tail -3 | tee $R/verifier.txt
  python3 -m eyas.cli $L8B --batch-sizes 1 --num-prompts $NP8B --max-tokens $MAXT --modes plain,chain:3 --repeat 3 \
    --out $R/l8b 2>&1 | grep "^| [pcm]"
  (cd $R/.. && tar czf $OUT/pdl_default_1.tar.gz pdl1)
else
  stage_b pdl2
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k smollm2 2>&1 | tail -3 \
    | tee $R/graph_tests.txt
  python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens $MAXT --prompts $S/question.jsonl \
    --batch-sizes 1 --num-prompts $NP --repeat 3 --modes plain,chain:3,tree:smollm2_48d5 --out $R/sm 2>&1 \
    | grep "^| [pctm]"
  i=0
  for rows in ${ORDER:-64 16}; do
    i=$((i + 1))
    python3 -c "import sys, eyas.models.one_row as o; o.FEW_ROWS_MAX = $rows; from eyas.cli import main; \
sys.argv = ['eyas'] + sys.argv[1:]; main()" bench latency --model smollm2 --draft default --max-tokens $MAXT \
      --prompts $S/question.jsonl --batch-sizes 1 --num-prompts $NPT --repeat 3 --modes tree:smollm2_48d5 \
      --out $R/rows${rows}_$i 2>&1 | grep "^| t" | sed "s/^/$i rows<=$rows /"
  done
  (cd $W && tar czf $OUT/pdl_default_2.tar.gz pdl2)
fi
