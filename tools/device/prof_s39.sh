# Session 39 (issue #5): kernel timelines (`--profile`'s kernels_*.tsv) of smollm2-shape's plain and default-tree
# steps (run N A's bf16 rank paths replayed, 4 x 48) and of the 8B shape's plain step (1k context, 4 x 32). One call,
# no staging; returns $OUT/prof.tar.gz (the logs and the timelines). Ran as call 6 (54 s); docs/benchmarks.md,
# "Session 39", reads the tree's verify layers from it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; W=/root/w; mkdir -p $W
python3 -m eyas.cli bench latency --model smollm2-shape --accept-ranks docs/bench/ranks_smollm2_runNa_bf16_gpu.safetensors --batch-sizes 1 --num-prompts 4 --max-tokens 48 --modes plain,tree:smollm2_48d5 --profile --out $W/s2 > $W/s2.log 2>&1
grep -E "GPU kernels per step|^\| (plain|tree)" $W/s2.log
python3 -m eyas.cli bench latency --model llama-3.1-8b-shape --context 1024 --batch-sizes 1 --num-prompts 4 --max-tokens 32 --modes plain --profile --out $W/l8 > $W/l8.log 2>&1
grep -E "GPU kernels per step|^\| plain" $W/l8.log
cd $W && tar czf $OUT/prof.tar.gz s2.log l8.log s2/kernels_* l8/kernels_*
