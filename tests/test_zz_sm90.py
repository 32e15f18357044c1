"""Every Triton kernel the CPU tests launched under the interpreter, compiled for sm_90 (the H200) without a GPU,
with the ptxas inside the triton wheel: the interpreter accepts kernels that ptxas rejects (session 10's
`.evict_last` load failed only on the GPU). tests/conftest.py records the launches (a few variants per kernel:
argument types, constexprs, warps, stages); this file, collected last, compiles them in a fresh process (after
interpreted runs the `tl` module of this one is the interpreter's). Run alone, it has nothing to compile and skips."""
import json
import os
import subprocess
import sys

import pytest

from conftest import TRITON_LAUNCHES

COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failures = []
for mod, name, sig, constexprs, options in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(mod), name)
    try:
        triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": options.get("num_warps", 4), "num_stages": options.get("num_stages", 3)})
    except Exception as e:
        failures.append(f"{mod}.{name} {constexprs}: {type(e).__name__}: {str(e)[-600:]}")
print(json.dumps(failures))
"""


def test_recorded_triton_kernels_compile_for_sm90():
    if not TRITON_LAUNCHES:
        pytest.skip("no interpreted Triton launch was recorded in this session (a GPU machine, or run alone)")
    try:
        import triton.backends.compiler  # noqa: F401
        import triton.compiler  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton has no offline compiler: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    variants = [list(v) for v in TRITON_LAUNCHES.values()]
    out = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(variants), capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failures, f"{len(failures)} of {len(variants)} kernel variants fail for sm_90:\n" + "\n".join(failures)
    print(f"compiled for sm_90: {len(variants)} variants of {len({(v[0], v[1]) for v in variants})} kernels")
