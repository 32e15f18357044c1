# Session 39 (issue #5 point 2a): where the decode_linear kernels let the next PDL launch in. The tile kernels
# (2-64 rows: the verify passes of the default tree and of chains, the draft's levels) triggered just before their
# stores; with `TILE_EARLY_TRIGGER` they trigger as soon as their weight loads are issued, before their own wait, so
# that the next kernel's programs (the tile grids have 30-120 programs, fewer than the H200's 132 SMs) can load their
# weights while this one computes. Small weights at trigger "start" do the same on the register kernel
# (SmolLM2's one-row linears: plain decoding, chains' draft levels).
# One call, no staging: the GPU tests of the tiles, then `smollm2-shape` with run N A's bf16
# rank paths replayed, batch 1, 8 x 64, plain, `chain:3` and the default tree, processes in ORDER (main small_end
# before tiles_late, twice) until BUDGET seconds.
# Ran in session 39 (call 7) when both were switches, off by default, with the variants main (neither), early (the
# tiles), start (the small weights) and both. Both are the defaults since, so the variants now turn them back: main
# (both early), small_end (the small weights at "end"), tiles_late (the tiles before their stores) and before
# (neither: session 38's code). docs/benchmarks.md, "Session 39".
source tools/device/ab_lib.sh
begin early
OUT=$R   # the rows are printed; nothing comes back
if [ "${TESTS:-1}" = 1 ]; then
  echo "== gpu tests [t=$(el)]"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_linear.py \
    -k "gpu and (few_rows or bf16_shapes or stash)" 2>&1 | tail -n 2
fi
i=0
for v in ${ORDER:-main small_end before tiles_late main small_end before tiles_late}; do
  [ $(el) -gt ${BUDGET:-480} ] && break
  i=$((i + 1))
  case $v in
    main) line="pass" ;;
    small_end) line="$SMALL_END" ;;
    tiles_late) line="m.TILE_EARLY_TRIGGER = False" ;;
    before) line="m.TILE_EARLY_TRIGGER = False; $SMALL_END" ;;
  esac
  switch_run ${v}_$i eyas.kernels.decode_linear "$line" bench latency --model smollm2-shape \
    --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors --batch-sizes 1 --num-prompts 8 \
    --max-tokens 64 --modes plain,chain:3,tree:smollm2_48d5
  echo "$v done [t=$(el)]"
done
latency_rows
