# Session 19's plan for session 20 (issue #5, point 1): programmatic dependent launch for the attention kernels of
# the one-row and few-rows paths (`eyas.kernels.tree_attention.PDL`, off on main until this is timed). With it the
# o projection's programs (PDL launches that load their weights before waiting) can start while the attention and
# its split reduction run, instead of after them. Processes alternated on one machine, the switch set from the
# command line. Each stage prints its rows and returns $OUT/attn_pdl_<stage>.tar.gz.
# STAGE=1 (carry .stage/a; copies part_aa to /root/stage for stage 2): the GPU tests of the row paths (with and
#   without the switch: tests/test_decode_linear.py -k gpu), then the 8B shape at 1k context, plain and chain:3.
# STAGE=2 (carry .stage/b, after stage 1): SmolLM2 over the MT-Bench first turns: plain, chain:3, the default tree.
# Env: NP8B (16), NP (40), MAXT (128), REPEAT (3), ORDER ("1 0 1 0"), TESTS (1).
set -u
NP8B=${NP8B:-16}; NP=${NP:-40}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}; export OUT
source tools/device/ab_lib.sh
SET='import eyas.kernels.tree_attention as t; t.PDL = on'
if [ "${STAGE:-1}" = 1 ]; then
  stage_a attn_pdl1
  [ "${TESTS:-1}" = 1 ] && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py -k gpu \
    2>&1 | tail -3 | tee $R/tests.txt
  alternate pdl "$SET" "^| [pc]" $R/l8b $L8B --batch-sizes 1 --num-prompts $NP8B --max-tokens $MAXT \
    --modes plain,chain:3 --repeat $REPEAT
  (cd $R/.. && tar czf $OUT/attn_pdl_1.tar.gz attn_pdl1)
else
  stage_b attn_pdl2
  alternate pdl "$SET" "^| [pct]" $R/sm bench latency --model smollm2 --draft default --max-tokens $MAXT \
    --prompts $S/question.jsonl --batch-sizes 1 --num-prompts $NP --repeat $REPEAT \
    --modes plain,chain:3,tree:smollm2_48d5
  (cd $W && tar czf $OUT/attn_pdl_2.tar.gz attn_pdl2)
fi
