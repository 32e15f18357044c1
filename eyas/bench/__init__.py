"""Benchmarks. `eyas.bench.tpc`: draft quality (tokens per target call, acceptance by depth) on a prompt set."""
