# Session 64: what the first request of a kind `eyas serve` does not capture ahead costs (log-probabilities,
# penalties, guided decoding; tools/diag/first_use_stall.py), on the real SmolLM2 and its shipped draft. Call 3 of
# three (calls 1 and 2 copied .stage/a/part_aa and .stage/b/part_ab to $S); carry .stage/c and .whl. BATCHES (1,4),
# MAXT (64), NSEQ (16: the engine's max_num_seqs; the server's default is 64).
source tools/device/thirds_lib.sh
stage_thirds || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export EYAS_SMOLLM2_GGUF=$S/smollm2.gguf PYTHONPATH=/tmp/site:$PWD
echo "== first use [t=$(el)]"
timeout ${T_S:-300} python3 tools/diag/first_use_stall.py --prompts $S/question.jsonl --batch-sizes ${BATCHES:-1,4} \
  --max-tokens ${MAXT:-64} --max-num-seqs ${NSEQ:-16} --out $OUT/first_use.json 2>&1 | grep -v Warn | tail -n 12 \
  | cut -c1-700
echo "[t=$(el)]"
