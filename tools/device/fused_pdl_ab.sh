# Session 21's plan for the next session (issue #5, points 2a and 3): programmatic dependent launch for the fused
# path's Triton kernels between its cuBLAS GEMMs (`eyas.models.llama.FUSED_PDL`, off on main until this is timed):
# the RoPE + K/V store launch, the attention and its split reduction. The verify passes of SmolLM2's default tree
# (49 rows) and of the 8B shape's chain:3 run this path; plain decoding at batch 1 does not (the one-row path), so
# the ratios of points 2a and 3 would gain what the verify passes gain. Processes alternated, the switch set from the
# command line. Each stage prints its rows and returns $OUT/fused_pdl_<stage>.tar.gz.
# STAGE=1 (carry .stage/a; copies the GGUF's first half to /root/stage for stage 2): the GPU tests (the fused path
#   with and without PDL gives the same tokens; the kernels' sm_90 compile), then the 8B shape at 1k context, plain
#   and chain:3 (run L's replayed rank paths), and batch 32.
# STAGE=2 (carry .stage/b, after stage 1): SmolLM2 over MT-Bench first turns: plain and the default tree at batch 1,
#   then the shipped dispatcher at 8 and 32 (tree:8 verify passes of 72 and 288 rows on the fused path).
# Env: NP8B (16), NP (40), MAXT (128), REPEAT (3), ORDER ("1 0 1 0"), TESTS (1).
set -u
NP8B=${NP8B:-16}; NP=${NP:-40}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}; export OUT
source tools/device/ab_lib.sh
SET='import eyas.models.llama as m; m.FUSED_PDL = on'
if [ "${STAGE:-1}" = 1 ]; then
  stage_a fused_pdl1
  [ "${TESTS:-1}" = 1 ] && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py \
    -k "gpu_fused_path_pdl or gpu_few_rows or gpu_one_row" 2>&1 | tail -3 | tee $R/tests.txt
  alternate fused_pdl "$SET" "^| [pc]" $R/l8b $L8B --batch-sizes 1,32 --num-prompts $NP8B --max-tokens $MAXT \
    --modes plain,chain:3 --repeat $REPEAT
  (cd $R/.. && tar czf $OUT/fused_pdl_1.tar.gz fused_pdl1)
else
  stage_b fused_pdl2
  alternate fused_pdl "$SET" "^| [pt]" $R/sm bench latency --model smollm2 --draft default --max-tokens $MAXT \
    --prompts $S/question.jsonl --batch-sizes 1 --num-prompts $NP --repeat $REPEAT --modes plain,tree:smollm2_48d5
  alternate fused_pdl "$SET" "^| [pd]" $R/smb bench latency --model smollm2 --draft default --max-tokens $MAXT \
    --prompts $S/question.jsonl --batch-sizes 8,32 --num-prompts 64 --repeat 2 \
    --modes plain,dispatch:4=tree:smollm2_48d5,32=tree:8,256=chain:3
  (cd $W && tar czf $OUT/fused_pdl_2.tar.gz fused_pdl2)
fi
