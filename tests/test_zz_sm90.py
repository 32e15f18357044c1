"""Every Triton kernel the CPU tests launched under the interpreter, compiled for sm_90 (the H200) without a GPU,
with the ptxas inside the triton wheel: the interpreter accepts kernels that ptxas rejects (session 10's
`.evict_last` load failed only on the GPU). tests/conftest.py records the launches (a few variants per kernel:
argument types, constexprs, warps, stages); this file, collected last, compiles them (`helpers.compile_for_sm90`).
`make test` runs the rest in parallel processes, which write their records to EYAS_SM90_RECORD, then this file alone
(`conftest.recorded_launches`). Run alone without records, it has nothing to compile and skips."""
import os

import pytest

from conftest import SM90_RECORD, recorded_launches
from helpers import compile_for_sm90


def test_recorded_triton_kernels_compile_for_sm90():
    launches = recorded_launches()
    if not launches and SM90_RECORD and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail(f"the parallel run wrote no interpreted Triton launch to EYAS_SM90_RECORD ({SM90_RECORD})")
    if not launches:
        pytest.skip("no interpreted Triton launch was recorded in this session (a GPU machine, or run alone)")
    try:
        import triton.backends.compiler  # noqa: F401
        import triton.compiler  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton has no offline compiler: {e}")
    variants = list(launches.values())
    # kernels with programmatic dependent launch: each also as the GPU launches it (tests/conftest.py adds these)
    pdl = {v[1] for v in variants if "USE_GDC" in v[3]}
    assert pdl == {v[1] for v in variants if v[3].get("USE_GDC") is True}, "a PDL kernel without its PDL variant"
    failures = [r["error"] for r in compile_for_sm90(variants) if r["error"]]
    assert not failures, f"{len(failures)} of {len(variants)} kernel variants fail for sm_90:\n" + "\n".join(failures)
    print(f"compiled for sm_90: {len(variants)} variants of {len({(v[0], v[1]) for v in variants})} kernels "
          f"({len(pdl)} of them also with PDL: {sorted(pdl)})")
