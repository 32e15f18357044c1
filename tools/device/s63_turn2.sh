# Session 63: a chat's second turn after a prefix-cache hit, old (f82b425: prefill graphs keyed by the decode graphs'
# context buckets, those after a prefix captured when first seen, at most 128 graphs) against new (the working tree:
# one key for a prefix of any length, `prefill_context`, captured ahead with the first chunks' by `capture_all`, 256
# graphs). Call 3 of three (calls 1 and 2 copied .stage/a/part_aa and .stage/b/part_ab to $S); carry .stage/c and .whl.
# .stage/c/old holds `git archive f82b425 eyas` without eyas/drafts (copied here). Each process runs from its code's
# root; the tool is this checkout's tools/diag/turn2_ttft.py in both. BATCHES (1 4), ROUNDS (1), NP (80), MAXT (64).
source tools/device/thirds_lib.sh
stage_thirds || exit 1
[ -d .stage/c/old/eyas/drafts ] || cp -r eyas/drafts .stage/c/old/eyas/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export EYAS_SMOLLM2_GGUF=$S/smollm2.gguf
NEW=$PWD
for round in ${ROUNDS:-1}; do
  for b in ${BATCHES:-1 4}; do
    for code in old new; do
      root=$NEW; [ $code = old ] && root=$NEW/.stage/c/old
      name=turn2_${code}_b${b}_r$round
      echo "== $name [t=$(el)]"
      (cd $root && PYTHONPATH=/tmp/site:$root timeout ${T_S:-200} python3 $NEW/tools/diag/turn2_ttft.py \
        --prompts $S/question.jsonl --num-prompts ${NP:-80} --batch $b --max-num-seqs $b --max-tokens ${MAXT:-64} \
        --out $OUT/$name.json 2>&1 | grep -v Warn | tail -n 2 | cut -c1-900)
    done
  done
done
echo "[t=$(el)]"
