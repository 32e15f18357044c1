#!/usr/bin/env bash
# Where `make-distill-data`'s time goes at batch 256 (session 46): tools/diag/engine_phases.py on run S's ShareGPT
# first turns (.stage/s46/sg.jsonl.xz), 40 s each, one process per variant MIN_ADMIT:MAX_BATCHED_TOKENS (0:
# make-distill-data's default, max(2048, 64 x batch) since 772294d, max(2048, 16 x batch) before). The first process
# on a fresh machine pays Triton's compiles: run a warm-up first.
# Calls: 1 (carry .stage/a) and 2 (carry .stage/b) as in thirds_lib.sh; 3 (carry .stage/c .stage/s46):
#   VARIANTS="1:0 1:16384 64:16384" bash tools/device/engine_phases.sh
source tools/device/thirds_lib.sh; stage_thirds || exit 1
for v in ${VARIANTS:-1:0 32:0 64:0 64:16384}; do
  a=${v%:*}; t=${v#*:}; tb=""; [ "$t" != 0 ] && tb="--max-batched-tokens $t"
  PYTHONPATH=.:$PYTHONPATH timeout 150 python3 tools/diag/engine_phases.py --data .stage/s46/sg.jsonl.xz \
    --time-budget ${PH_S:-40} --min-admit $a $tb > $OUT/ph_${a}_$t.json 2> $W/err_${a}_$t.txt
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d['generated_tokens_per_second'], d['seconds'], d['step_other'], d['outside_steps'], d['prefill_mean_seqs'], d['decode_mean_batch'], d['commit_us'], d['counts']['prefill'], d['counts']['launch'])" $OUT/ph_${a}_$t.json || tail -3 $W/err_${a}_$t.txt
done
