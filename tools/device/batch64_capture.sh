# Session 36 (issue #5; what session 35 left unmeasured), one call on a fresh single-H200 machine, no staging:
# 1. the draft's FP8 head (the shipped default) at batch 32 and 64, where the dispatcher runs `chain:3` and its head
#    scores more than 16 rows (on the dequantised reference, not the FP8 GEMV): smollm2-shape, run N A's bf16 rank
#    paths replayed, processes alternated fp8-head / none / fp8-head;
# 2. the server's startup capture (`capture_all`, 64 sequences, 8192-token context, the shipped dispatcher) with the
#    context buckets and without them (tools/diag/capture_time.py), in both orders.
set -u
source tools/device/ab_lib.sh
begin b64
B64="--batch-sizes 32,64 --num-prompts 64 --max-tokens 64 --modes plain,chain:3,tree:8"
echo "== capture [t=$(el)]"
for b in default none none default; do
  timeout 150 python3 tools/diag/capture_time.py --buckets $b 2>&1 | tail -n 1
done
echo "== batch 32/64 [t=$(el)]"
s2_run fp8a "pass" $B64
s2_run none "pass" $B64 --draft-quant none
s2_run fp8b "pass" $B64
latency_rows
echo "done [t=$(el)]"
