# Session 21 (issue #5, point 3): the benchmarks' replayed acceptance in one Triton launch (`replay_accept_triton`,
# 63544f9) against the torch replay it replaced (`simulate_replay`, ~20 small kernels), in the 8B shape's graphed
# chain:3 step. Processes alternated on one machine; the torch side swaps the module's function from the command
# line (as spec/step.py imports it at call time). Carry .stage/a (the GGUF's first half is copied to /root/stage).
# First the GPU tests that session 20 changed without a GPU run: the tiny models' graph tests (the dispatcher case
# now compares greedy requests) and the acceptance kernels (tests/test_verifier.py).
# Env: NP8B (16), MAXT (128), REPEAT (3), ORDER ("1 0 1 0"), TESTS (1). Returns $OUT/replay_ab.tar.gz.
set -u
NP8B=${NP8B:-16}; MAXT=${MAXT:-128}; REPEAT=${REPEAT:-3}; export OUT
source tools/device/ab_lib.sh
TORCH_REPLAY='if not on:
    import eyas.kernels.accept_greedy as a
    from eyas.spec.verifier import simulate_replay
    a.replay_accept_triton = lambda r, s, n, am, nt, tree: (*simulate_replay(nt, tree, r, s, n, am), None)'
stage_a replay_ab
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k "not smollm2" 2>&1 | tail -3 \
    | tee $R/graph_tests.txt
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_verifier.py 2>&1 | tail -3 | tee $R/verifier.txt
fi
alternate triton_replay "$TORCH_REPLAY" "^| [pc]" $R/l8b $L8B --batch-sizes 1 --num-prompts $NP8B \
  --max-tokens $MAXT --modes plain,chain:3 --repeat $REPEAT
(cd $R/.. && tar czf $OUT/replay_ab.tar.gz replay_ab)
