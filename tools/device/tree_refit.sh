# Session 17: the default tree refitted to today's draft and step costs (issue #5 point 2a). Candidate trees
# (`eyas make-tree` on SmolLM2's answers to ShareGPT prompts, never MT-Bench) are timed on the MT-Bench first turns
# next to plain decoding and the shipped default; the choice then divides each candidate's measured ms a step by its
# TPC replayed on the fit data (`eyas make-tree` prints it), so MT-Bench's acceptance does not pick the tree.
# Carry .stage/b and TREES (a folder of candidate tree JSON files); part_aa staged by an earlier call of the machine.
# Env: TREES (.stage/trees), NP (prompts, 40), MAXT (128), REPEAT (2), MODES_EXTRA (more modes, comma-separated).
# Returns $OUT/tree_refit.tar.gz (the latency JSON and table).
set -u
source tools/device/stage_smollm2.sh
TREES=${TREES:-.stage/trees}; NP=${NP:-40}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-2}
R=$W/tree_refit; mkdir -p $R
modes=plain,tree:smollm2_48d5
for f in $TREES/*.json; do modes=$modes,$f; done
[ -n "${MODES_EXTRA:-}" ] && modes=$modes,$MODES_EXTRA
python3 -m eyas.cli bench latency --model smollm2 --draft default --max-tokens $MAXT --prompts $S/question.jsonl \
  --batch-sizes 1 --num-prompts $NP --repeat $REPEAT --modes $modes --out $R/rows 2>&1 | grep "^| "
(cd $W && tar czf $OUT/tree_refit.tar.gz tree_refit)
