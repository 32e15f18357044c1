import gc
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU-only machines (CI)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# two threads on CI's two cores; under pytest-xdist (`-n N`) the cores are shared among the N workers
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MT_BENCH = SHARED / "data" / "mt_bench" / "question.jsonl"


def mt_bench_first_turns(n: int | None = None) -> list[str]:
    if not MT_BENCH.exists():
        pytest.skip(f"{MT_BENCH} is absent")
    qs = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return qs[:n] if n else qs


# ---- KV pools of CPU engines -----------------------------------------------------------------------------------------
# Without num_blocks or kv_cache_bytes an engine sizes its KV pool from a 1 GiB budget on the CPU
# (`LLMEngine._blocks_from_memory`): ~170k blocks for a tiny test model, whose zeroing took 0.3-0.6 s an engine, 340 s
# of the suite's summed time in its ~1,000 pools. Here such a CPU engine gets at most CPU_POOL_BLOCKS blocks (64k
# tokens at block_size 16, 16k at 4: more than any test holds); SmolLM2's pools (1,409 blocks with its draft, 1,456
# without) are below that and keep their size. Engines in other processes (tensor-parallel ranks, subprocesses) keep
# the budget's pool.
# On a GPU an engine takes 60% of the free memory (at most 2^20 blocks: 16 GiB for a tiny float32 test model), so
# pytest-xdist's workers on one GPU, and engines a worker keeps alive, leave each other little (session 64: an
# out-of-memory failure beside three workers). Such a GPU engine gets at most GPU_POOL_BLOCKS blocks (256k tokens at
# block_size 16; SmolLM2 and its draft: 6.2 GB): session 65's `pytest -n 4` of the graph files peaked at 9.7 GB of
# the H100's 80. (It did not stop the overlapped test's capture failures: `eyas.engine.cuda_graph.capturing`.)
CPU_POOL_BLOCKS = 4096
GPU_POOL_BLOCKS = 16384


def _cap_pools():
    from eyas.engine.engine import LLMEngine
    sized = LLMEngine._blocks_from_memory
    if getattr(sized, "_eyas_capped", False):
        return

    def capped(self, target, draft):
        n = sized(self, target, draft)
        if self.config.kv_cache_bytes is None:
            return min(n, GPU_POOL_BLOCKS if next(target.parameters()).device.type == "cuda" else CPU_POOL_BLOCKS)
        return n

    capped._eyas_capped = True
    LLMEngine._blocks_from_memory = capped


_cap_pools()


# ---- memory: engines that tests leave in reference cycles ----------------------------------------------------------
# An LLM is freed by reference counting once dropped, but a test that patches one of its engine's methods with a
# closure over the LLM (to count steps, say) makes a cycle, which only the cycle collector frees; it runs by object
# counts, not bytes, so such engines (each with its KV pool, 1 GiB on the CPU by default) piled up to ~16 GB in one
# worker (session 52: test_overlap). After a test that left the process 1.5 GiB larger than after the last
# collection, collect (~0.2 s; most tests do not trigger it). On a GPU the same holds for device memory, where it
# matters more: an engine's KV pool takes 60% of the free memory, so each engine kept alive shrinks the next one's
# pool (session 52's device run of tests/test_cuda_graph.py, where earlier tests' engines were left in cycles).
_RSS_AT_COLLECT = [0]
_CUDA_AT_COLLECT = [0]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@pytest.fixture(autouse=True)
def _collect_cycles_when_memory_grows():
    yield
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if _rss_bytes() > _RSS_AT_COLLECT[0] + (3 << 29) or (
            cuda and torch.cuda.memory_allocated() > _CUDA_AT_COLLECT[0] + (1 << 30)):
        gc.collect()
        _RSS_AT_COLLECT[0] = _rss_bytes()
        if cuda:
            torch.cuda.empty_cache()
            _CUDA_AT_COLLECT[0] = torch.cuda.memory_allocated()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once per test session (float32, CPU)."""
    from eyas import LLM
    return LLM("smollm2", device="cpu", dtype="float32")


_SMOLLM2_TOKENIZER: list = []


def smollm2_tokenizer():
    """SmolLM2's tokenizer alone (skips when the model package is absent): read from the GGUF file once per process
    (~4 s, the reader walks the file's metadata fields one by one), a copy of it (~0.2 s) for each caller."""
    import copy

    from eyas.loader.gguf import load_gguf_tokenizer
    from eyas.loader.resolve import smollm2_path
    if not _SMOLLM2_TOKENIZER:
        try:
            path = smollm2_path()
        except ValueError as e:
            pytest.skip(str(e))
        _SMOLLM2_TOKENIZER.append(load_gguf_tokenizer(path))
    return copy.deepcopy(_SMOLLM2_TOKENIZER[0])


# ---- every interpreted Triton launch, recorded for tests/test_zz_sm90.py ------------------------------------------
# On a machine without a GPU the Triton kernels run under the interpreter, which accepts kernels that ptxas rejects.
# The launches the tests make are recorded here (kernel, arguments' types, constexprs, launch options: a few per
# kernel), and tests/test_zz_sm90.py, collected last, compiles each for sm_90 with the ptxas in the triton wheel.
TRITON_LAUNCHES: dict = {}  # (kernel name, signature, constexprs) -> (module, name, signature, constexprs, options)


def _record_triton_launches():
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    if getattr(InterpretedFunction.run, "_eyas_recording", False):
        return
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            _note_launch(self, args, kwargs)
        except Exception:  # recording must never break a test
            pass
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._eyas_recording = True
    InterpretedFunction.run = run


_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float8_e4m3fn: "*fp8e4nv",
        torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
        torch.bool: "*i1"}


def _note_launch(fn, args, kwargs):
    import inspect
    params = list(inspect.signature(fn.fn).parameters.values())
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k not in options})  # `kwargs` itself goes on to the launch
    sig, constexprs = {}, {}
    for p in params:
        v = bound.get(p.name, p.default)
        is_constexpr = "constexpr" in str(p.annotation)
        if is_constexpr or v is None:
            sig[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _PTR[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            return
    if any(v is not None and not isinstance(v, (bool, int, float, str)) for v in constexprs.values()):
        return  # e.g. a dtype as a constexpr: not recorded
    name = f"{fn.fn.__module__}.{fn.fn.__qualname__}"
    key = (name, tuple(sig.items()), tuple((k, repr(v)) for k, v in constexprs.items()))
    if _admits(TRITON_LAUNCHES, key):
        TRITON_LAUNCHES[key] = (fn.fn.__module__, fn.fn.__qualname__, sig, constexprs, options)
    # the interpreter never takes programmatic dependent launch (USE_GDC), the GPU does: one such variant too
    if constexprs.get("USE_GDC") is False and _admits(TRITON_LAUNCHES, key + ("gdc",)):
        gdc = dict(constexprs, USE_GDC=True)
        TRITON_LAUNCHES[key + ("gdc",)] = (fn.fn.__module__, fn.fn.__qualname__, sig, gdc, options)
    # nor libdevice's IEEE division, exp and log (PRECISE: the interpreter has no libdevice), the GPU does
    if constexprs.get("PRECISE") is False and _admits(TRITON_LAUNCHES, key + ("precise",)):
        precise = dict(constexprs, PRECISE=True, **({"USE_GDC": True} if "USE_GDC" in constexprs else {}))
        TRITON_LAUNCHES[key + ("precise",)] = (fn.fn.__module__, fn.fn.__qualname__, sig, precise, options)


def _admits(launches: dict, key: tuple) -> bool:
    """The recording's bound: a few variants per kernel (3, its PDL variant among them), one PDL variant and one
    with libdevice (PRECISE)."""
    if key in launches:
        return False
    same = [k for k in launches if k[0] == key[0]]
    if key[3:] in (("gdc",), ("precise",)):
        return not any(k[3:] == key[3:] for k in same)
    return len(same) < 3


# ---- the interpreter's nested calls, without re-patching ------------------------------------------------------------
# Triton's interpreter patches `triton.language` (inspect.getmembers over its modules, ~1 ms) when a launch starts,
# and again at every call of a @triton.jit helper from inside the kernel, although the launch's patch is in place
# then: in the sampler's tests (a helper called per program, per radix pass) that was half their time. Inside a
# launch that has patched the language modules the helper sees, the helper's patch is skipped (session 71, two
# workers: the suite 612 -> 555 s, the logits sampler's preset tests 28 -> 12 s each). Should a helper ever run
# unpatched, its builtins raise (they need the interpreter's semantic), so this cannot pass a test wrongly.
_LAUNCH: dict = {"langs": None}


def _interpret_helpers_without_repatching():
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, grid_call = getattr(interpreter, "_patch_lang", None), getattr(interpreter.GridExecutor, "__call__", None)
    if patch is None or grid_call is None or getattr(patch, "_eyas", False):
        return
    import triton.language as tl

    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    class _Kept:  # the launch's own patch stays; nothing to restore
        def restore(self):
            pass

    def patch_lang(fn):  # the launch's own patch first (no module patched yet), then its helpers'
        if _LAUNCH["langs"] is None:  # outside a launch
            return patch(fn)
        if langs(fn) <= _LAUNCH["langs"]:
            return _Kept()
        _LAUNCH["langs"] |= langs(fn)  # e.g. tl.sum's module sees `core`, not `tl`: patched once per launch
        return patch(fn)

    def launch(self, *args, **kwargs):
        outer, _LAUNCH["langs"] = _LAUNCH["langs"], frozenset()  # the language modules this launch has patched
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _LAUNCH["langs"] = outer

    patch_lang._eyas = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _record_triton_launches()
    _interpret_helpers_without_repatching()

# `make test` runs the suite in parallel processes (pytest-xdist), so no one process sees every launch: with
# EYAS_SM90_RECORD set (a folder), each process writes what it recorded there when it ends, and a second pytest run of
# tests/test_zz_sm90.py compiles the union (`recorded_launches`).
SM90_RECORD = os.environ.get("EYAS_SM90_RECORD")


def pytest_sessionfinish(session, exitstatus):
    if SM90_RECORD and TRITON_LAUNCHES:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        folder = Path(SM90_RECORD)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"launches-{worker}-{os.getpid()}.json").write_text(
            json.dumps([[k, v] for k, v in TRITON_LAUNCHES.items()]))


def _frozen(x):
    return tuple(_frozen(e) for e in x) if isinstance(x, list) else x


def recorded_launches() -> dict:
    """This process's recorded launches, and those the processes of an earlier run wrote to EYAS_SM90_RECORD, under
    the recording's own bound per kernel (`_admits`)."""
    launches = dict(TRITON_LAUNCHES)
    files = sorted(Path(SM90_RECORD).glob("launches-*.json")) if SM90_RECORD else []
    for f in files:
        for key, value in json.loads(f.read_text()):
            key = _frozen(key)
            if _admits(launches, key):
                launches[key] = tuple(value)
    return launches
