# Session 17: SmolLM2's default tree with a 32k draft vocabulary (issue #5 point 2a). The draft's LM head (49,152 x
# 576, read at every draft level: 15-20 us of a 1.38 ms tree step) shrinks by a third; its replayed TPC on MT-Bench
# fell 0.85% in session 13's CPU replay. Two processes, each plain and the tree interleaved (--repeat), alternating:
# the shipped draft, the same draft with DV (a copy with draft_vocab.safetensors beside it), then both again.
# Carry .stage/b and DV (.stage/dv32); part_aa staged by an earlier call of the machine.
# Env: DV, NP (80), MAXT (128), REPEAT (3). Returns $OUT/draft_vocab_rows.tar.gz.
set -u
source tools/device/stage_smollm2.sh
DV=${DV:-.stage/dv32}; NP=${NP:-80}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}
R=$W/draft_vocab_rows; mkdir -p $R
for run in a b; do
  for d in default $DV; do
    name=${run}_$(basename $d)
    python3 -m eyas.cli bench latency --model smollm2 --draft $d --max-tokens $MAXT --prompts $S/question.jsonl \
      --batch-sizes 1 --num-prompts $NP --repeat $REPEAT --modes plain,tree:smollm2_48d5 --out $R/$name 2>&1 \
      | grep "^| [pt]" | sed "s/^/$name /"
  done
done
(cd $W && tar czf $OUT/draft_vocab_rows.tar.gz draft_vocab_rows)
