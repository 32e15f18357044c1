#!/usr/bin/env bash
# Issue #5, points 2a and 3 (session 25): do the verify passes that stay on cuBLAS (the 8B shape's chain:3 at 4 rows,
# SmolLM2's default tree at 49 rows) run faster with torch's cuBLASLt backend
# (torch.backends.cuda.preferred_blas_library("cublaslt"))? First each verify projection alone
# (tools/diag/blas_pref_bench.py), then the 8B shape's chain:3 at batch 1 (80 prompts x 128, ab_lib's L8B) in
# processes alternated with cuBLASLt (on) and cuBLAS (off, torch's default). No carry.
# The engine's A/B runs only where cuBLASLt's 8B layer at that batch's verify rows is >= 1% faster alone: at batch 1
# (4 rows) it was not (session 25: the same kernels); at 32 rows o and down were ~5 us a layer faster, so
# BATCH=32 NP8B=32 is the A/B to run next (plain decoding and chain:3 at batch 32).
# Env: NP8B (80), MAXT (128), BATCH (1, or 32: the gate is then the 32-row layer, plain decoding's rows; chain:3's
# 128 verify rows are not timed alone), ORDER ("1 0 1 0"), SKIP_ENGINE (unset).
set -u
NP8B=${NP8B:-80}; MAXT=${MAXT:-128}; BATCH=${BATCH:-1}
source tools/device/ab_lib.sh
begin blaslt
echo "== the verify projections on cuBLAS and cuBLASLt [t=$(el)]"
timeout 120 python3 tools/diag/blas_pref_bench.py --out $OUT/blas_pref.json 2>&1 | grep -v "^ *$"
[ -n "${SKIP_ENGINE:-}" ] && exit 0
# the engine's A/B only where cuBLASLt's 8B layer is >= 1% faster alone: at 4 rows for batch 1 (chain:3's verify
# rows), at BATCH rows otherwise
M=$(( BATCH == 1 ? 4 : BATCH ))
python3 -c "import json, sys; r = [x for x in json.load(open('$OUT/blas_pref.json'))['rows'] if x['model'] == '8b' and x['M'] == $M]
sys.exit(0 if r and sum(x['cublaslt_us'] for x in r) < 0.99 * sum(x['cublas_us'] for x in r) else 1)" || { echo "== no gain alone at $M rows: no engine A/B"; exit 0; }
echo "== 8B chain:3 at batch $BATCH, cuBLASLt or cuBLAS [t=$(el)]"
alternate blaslt "import torch
torch.backends.cuda.preferred_blas_library('cublaslt' if on else 'cublas')" "^| [pc]" $R/l8b $L8B --batch-sizes $BATCH \
  --num-prompts $NP8B --max-tokens $MAXT --modes plain,chain:3 --repeat 1
(cd $R/.. && tar czf $OUT/blaslt.tar.gz blaslt)
echo "== end [t=$(el)]"
