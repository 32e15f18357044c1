# Session 53: what requests with log-probabilities or penalties cost their batch on graphs, main against session
# 52's code (2872cf5: such steps not overlapped, the penalties' counts rebuilt from every token each step), in one
# call, processes alternated. Before it, the two staging calls (tools/device/README.md); here:
#   git archive 2872cf5 eyas | tar -x -C .stage/old53 && rm -r .stage/old53/eyas/drafts   (the drafts: main's)
# carry .stage/c .whl .stage/old53:   bash tools/device/extras_ab.sh
# KINDS, SIZES, TOK, SPEC, ORDER to change the rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
source tools/device/thirds_lib.sh
stage_thirds || exit 1
cp -r eyas/drafts .stage/old53/eyas/
for v in ${ORDER:-main old main old}; do
  [ $v = main ] && P=/tmp/site:$PWD || P=/tmp/site:$PWD/.stage/old53
  echo "== $v [t=$(el)]"
  PYTHONPATH=$P timeout ${ROW_S:-200} python3 tools/diag/extras_cost.py --prompts $S/question.jsonl --modes graphed \
    --batch-sizes ${SIZES:-1,8,32} --kinds ${KINDS:-free,logprobs,penalties,all} --max-tokens ${TOK:-64} --repeat 2 \
    --speculation ${SPEC:-auto} --out $OUT/extras_${v}_$(el).json 2>&1 | grep -v Warning | tail -n 13
done
echo "done [t=$(el)]"
