import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU-only machines (CI)
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MT_BENCH = SHARED / "data" / "mt_bench" / "question.jsonl"


def mt_bench_first_turns(n: int | None = None) -> list[str]:
    if not MT_BENCH.exists():
        pytest.skip(f"{MT_BENCH} is absent")
    qs = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return qs[:n] if n else qs


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once per test session (float32, CPU)."""
    from eyas import LLM
    return LLM("smollm2", device="cpu", dtype="float32")


def smollm2_tokenizer():
    """SmolLM2's tokenizer alone (skips when the model package is absent)."""
    from eyas.loader.gguf import load_gguf_tokenizer
    from eyas.loader.resolve import smollm2_path
    try:
        path = smollm2_path()
    except ValueError as e:
        pytest.skip(str(e))
    return load_gguf_tokenizer(path)
