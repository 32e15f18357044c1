# Session 38: does the whole-K tile up to 64 rows (WHOLE_K_ROWS = 64, one_row.FEW_ROWS_MAX = 64: the rule's configs
# for 17-64 rows) cost anything at the batch sizes whose launches it moves off cuBLAS? smollm2-shape, run N A's bf16
# rank paths replayed, 16 prompts x 64 tokens; the default tree (49 rows at batch 1), tree:8 (36 rows at batch 4) and
# chain:3 (32 rows at batch 8, 64 at 16); processes alternated (ORDER, default "main w64 w64 main").
# Call 1 of whole_k_real.sh's three (carry .stage/a): bash tools/device/wide_batches.sh. Since session 38 main's
# defaults are those 64 rows: set W64 to another switch to compare against them.
set -u
source tools/device/ab_lib.sh
mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
begin wide_batches
W64=${W64:-"m.WHOLE_K_ROWS = 64; import eyas.models.one_row as o; o.FEW_ROWS_MAX = 64"}
main_vs w64 "$W64" bench latency --model smollm2-shape --context 128 \
  --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors --batch-sizes ${BATCHES:-1,4,8,16} \
  --num-prompts 16 --max-tokens 64 --modes ${MODES:-chain:3,tree:8,tree:smollm2_48d5}
echo "== rows [t=$(el)]"
latency_rows
