#!/usr/bin/env bash
# Issue 7 (tensor parallelism) on nvidia-h200-x2, in parts that fit the device tool's 10-minute calls:
#   PART=1: the NCCL test (TP = 2 == TP = 1 with CUDA graphs), then the Llama-3.1-8B shape at TP = 1 and TP = 2
#           (plain, chain:3 and the default tree at batch 1 and 8; chain:3 with the draft sharded too);
#   PART=2: the Llama-3.3-70B shape at TP = 2, batch 1 (plain and chain:3, the draft replicated or sharded), then the
#           10-minute soak started detached (`setsid`), so that it runs on after the call;
#   PART=3: the sampler's reproducibility test, then the soak again (detached), waited on for WAIT_S (540) seconds;
#   PART=soak: waits for the soak (at most WAIT_S seconds) and returns its report and log.
# Results come back in $OUT as tp_PART.tar (the JSON, markdown and plots of each run) and the logs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: never multicast
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
W=${W:-/root/w}; OUT=${OUT:-/tmp/out}; mkdir -p $W $OUT; touch $W/.t0_${PART:-1}
R=docs/bench/ranks_smollm2_runG_mtbench.safetensors
LAT="python3 -m eyas.cli bench latency --context 1024 --max-tokens 64 --accept-ranks $R"
run() {  # name timeout command...: the command's output to $W/name.log, its tail here
  local name=$1 t=$2; shift 2
  echo "== $name [t=$(el)] $*"
  timeout $t "$@" > $W/$name.log 2>&1; local rc=$?; echo "rc=$rc [t=$(el)]"
  tr '\r' '\n' < $W/$name.log | grep -v "it/s\]\|s/it\]" | tail -${TAIL:-25}
  return $rc
}
[ "${PART:-1}" = soak ] || pkill -f "eyas.cli bench latency" ; case ${PART:-1} in
1)
  nvidia-smi topo -m
  python3 -c "import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.nccl.version())"
  run nccl_test ${TEST_S:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_tp.py -k nccl; ok=$?
  M="--model llama-3.1-8b-shape --modes plain,chain:3,tree:smollm2_48d5 --batch-sizes 1,8 --num-prompts 16"
  run l8b_tp1 ${LAT_S:-200} $LAT $M --out $W/l8b_tp1
  [ $ok = 0 ] || M="$M --no-cuda-graphs"  # the NCCL test failed: TP = 2 rows without graphs, to see what else fails
  run l8b_tp2 ${LAT_S:-200} $LAT $M --tensor-parallel 2 --tp-draft replicated --out $W/l8b_tp2
  run l8b_tp2_sharded_draft ${LAT_S:-200} $LAT --model llama-3.1-8b-shape --modes chain:3 --batch-sizes 1,8 \
    --num-prompts 16 --tensor-parallel 2 --tp-draft sharded --out $W/l8b_tp2s
  ;;
2)
  M="--model llama-3.3-70b-shape --batch-sizes 1 --num-prompts 8 --tensor-parallel 2"
  run l70b_tp2 ${LAT70_S:-240} $LAT $M --modes plain,chain:3 --tp-draft replicated --out $W/l70b_tp2
  run l70b_tp2_sharded_draft ${LAT70_S:-240} $LAT $M --modes chain:3 --tp-draft sharded --out $W/l70b_tp2s
  echo "== soak started [t=$(el)]"
  setsid nohup python3 -m eyas.cli bench soak --model llama-3.1-8b-shape --tensor-parallel 2 \
    --duration ${SOAK_S:-600} --grace 300 --tp-draft ${SOAK_DRAFT:-replicated} --accept-ranks $R --num-blocks 4096 --report-every 20 --out $W/soak \
    > $W/soak.log 2>&1 < /dev/null &
  sleep 45; cat $W/soak/soak.json 2>/dev/null | head -30; grep -v "s/s\]" $W/soak.log | tail -5
  ;;
3)  # the soak again, after the sampler's fix: the sampler's reproducibility test first, then the soak, waited on
  run sampler_test 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_spec_distribution.py -k reproducible
  echo "== soak started [t=$(el)]"
  setsid nohup python3 -m eyas.cli bench soak --model llama-3.1-8b-shape --tensor-parallel 2 \
    --duration ${SOAK_S:-600} --grace 300 --tp-draft ${SOAK_DRAFT:-replicated} --accept-ranks $R --num-blocks 4096 --report-every 20 --out $W/soak \
    > $W/soak.log 2>&1 < /dev/null &
  deadline=$(( T0 + ${WAIT_S:-540} ))
  while pgrep -f "bench soak" > /dev/null && [ $(date +%s) -lt $deadline ]; do sleep 5; done
  head -14 $W/soak/soak.json; tr '\r' '\n' < $W/soak.log | grep -v "^soak:" | tail -5
  ;;
soak)
  deadline=$(( T0 + ${WAIT_S:-500} ))
  while pgrep -f "bench soak" > /dev/null && [ $(date +%s) -lt $deadline ]; do sleep 5; done
  pgrep -f "bench soak" > /dev/null && echo "soak still running at t=$(el)"
  cp $W/soak/soak.json $OUT/ 2>/dev/null; cat $W/soak/soak.json
  tr '\r' '\n' < $W/soak.log | grep -v "^soak:" | tail -40 > $OUT/soak_tail.log; tail -20 $OUT/soak_tail.log
  ;;
esac
if [ "${PART:-1}" = 1 ] || [ "${PART:-1}" = 2 ]; then  # $OUT returns at most 8 files
  (cd $W && ls -d l8b_* l70b_* 2>/dev/null | xargs -r tar cf $OUT/tp_${PART:-1}.tar --exclude='*.log')
  for f in $W/*.log; do [ $f -nt $W/.t0_${PART:-1} ] && cp $f $OUT/; done
fi
ls $OUT
echo "== end [t=$(el)]"
