"""Kernels per decode step, counted on the CPU, by source line: what a graphed step launches on the GPU.

At batch 1 a SmolLM2 step is launch-bound: its time follows the number of kernels it runs (session 5: ~3 us each
inside a CUDA graph). This counts them without a GPU: the fast path (fused ops, Triton kernels under
TRITON_INTERPRET=1) runs on a random model of SmolLM2's depth (30 layers, tiny widths), and one decode step counts
every ATen op that launches work (views and allocations excluded) and every Triton launch, by the eyas source line
that issued it.

    PYTHONPATH=. python3 tools/diag/step_kernels.py --speculation plain chain:3 tree:smollm2_48d5 [--by-line]
        [--fast-path]

`--fast-path` takes the one-row and few-rows paths (`enable_fast_path`) as CUDA does for a small model. Session 40,
the default tree with it: 269 kernels a step, 263 with `eyas.spec.step.FUSED_PROLOGUE` on (the step's index work
around the draft's catch-up: 9 small ops become the two launches of `eyas.kernels.spec_prologue`; the default since
session 42). Session 41's fused feature commit (266; `chain:3` 234 -> 231) lost on the GPU and was removed. Session
42, with the prologue: plain 191, `chain:3` 227, the default tree 262.

The count is an estimate of the GPU's: some ATen ops are several CUDA kernels there (e.g. cuBLAS split-K GEMMs), a
few are none (a copy of 0 bytes), and on CPU tensors the top-k and argmax take their PyTorch path (`eyas.layers.topk`),
where CUDA runs two Triton launches each. Compare counts with each other, not with a profile.
"""
from __future__ import annotations

import argparse
import collections
import os
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ops that launch nothing: views, metadata, allocation
FREE = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "transpose",
        "permute", "as_strided", "detach", "alias", "empty", "empty_strided", "split", "split_with_sizes",
        "chunk", "unbind", "lift_fresh", "_reshape_alias", "view_as", "_local_scalar_dense", "is_same_size",
        "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride", "numel", "new_empty", "new_empty_strided",
        "unflatten", "flatten", "narrow", "expand_as", "diagonal", "movedim", "promote_types", "result_type"}


def _site() -> str:
    """The innermost eyas source line on the stack (the code that asked for the kernel)."""
    for fr in reversed(traceback.extract_stack()[:-3]):
        if "/eyas/" in fr.filename and "/kernels/" not in fr.filename:
            return f"{fr.filename.split('/eyas/', 1)[1]}:{fr.lineno} {fr.line}"
    return "?"


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_site: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self.inside_triton = False  # the interpreter's own tensor ops are not kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # an out-of-place op whose result is its input's storage (`.to` of the same dtype, `.contiguous()` of a
        # contiguous tensor) launched nothing
        aliased = (not name.endswith("_") and isinstance(out, torch.Tensor) and args
                   and isinstance(args[0], torch.Tensor) and out.data_ptr() == args[0].data_ptr())
        if name not in FREE and not aliased and not self.inside_triton:
            self.by_site[_site()] += 1
            self.by_op[name] += 1
        return out

    def triton_launch(self, fn_name: str) -> None:
        self.by_site[_site()] += 1
        self.by_op[f"triton:{fn_name}"] += 1


def count_step(speculation: str, layers: int, feature_layers, context: int, fast_path: bool = False):
    from eyas.config import ModelConfig
    from eyas.engine import runner as runner_mod
    from eyas.engine.engine import EngineConfig, LLMEngine
    from eyas.engine.runner import ModelRunner
    from eyas.models.eagle import EagleDraft
    from eyas.models.llama import LlamaForCausalLM
    from eyas.sampling_params import SamplingParams
    from eyas.spec.tree import resolve_tree

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    target = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()  # bf16 as on the GPU: its casts are kernels
    draft = None
    if speculation != "plain":
        dcfg = ModelConfig(**{**cfg.__dict__, "num_hidden_layers": 1, "feature_layers": feature_layers})
        draft = EagleDraft(dcfg).to(torch.bfloat16).eval()
    tree = resolve_tree(None if speculation == "plain" else speculation)
    ecfg = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4)
    eng = LLMEngine(target, None, draft, tree, ecfg)
    eng.runner = ModelRunner(target, draft, tree, 64, 16, use_triton=True, max_model_len=cfg.max_position_embeddings,
                             max_num_seqs=4)
    if fast_path:  # the row paths as CUDA takes them (register and tile kernels, the draft's catch-up on the tiles)
        from eyas.models.fused import enable_fast_path
        for m in (target, draft):
            if m is not None:
                enable_fast_path(m)
    eng.eos_ids = set()
    eng.add_request(list(range(1, context + 1)), SamplingParams(temperature=0.0, max_tokens=64))

    counter = Counter()
    real_step = runner_mod.spec_step
    counted = {"on": False}

    def step(*a, **k):
        if not counted["on"]:
            return real_step(*a, **k)
        with counter:
            return real_step(*a, **k)

    from triton.runtime.interpreter import InterpretedFunction
    real_run = InterpretedFunction.run

    def run(self, *a, **k):
        if not counted["on"]:
            return real_run(self, *a, **k)
        counter.triton_launch(getattr(self.fn, "__name__", "?"))
        counter.inside_triton = True
        try:
            return real_run(self, *a, **k)
        finally:
            counter.inside_triton = False

    runner_mod.spec_step = step
    InterpretedFunction.run = run
    try:
        with torch.inference_mode():
            eng.step()  # prefill
            eng.step()  # a first decode step (warm-up)
            counted["on"] = True
            eng.step()
    finally:
        runner_mod.spec_step = real_step
        InterpretedFunction.run = real_run
    return counter


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speculation", nargs="+", default=["plain", "chain:3", "tree:smollm2_48d5"])
    ap.add_argument("--layers", type=int, default=30, help="target layers (SmolLM2: 30)")
    ap.add_argument("--feature-layers", type=int, nargs="*", default=[3, 15],
                    help="the draft's feature layers (the shipped draft's: 3 15; none: EAGLE-1)")
    ap.add_argument("--context", type=int, default=40, help="prompt tokens")
    ap.add_argument("--fast-path", action="store_true",
                    help="the one-row and few-rows paths (`enable_fast_path`), as CUDA runs a small model's steps")
    ap.add_argument("--by-line", action="store_true", help="print the count per source line")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    fl = tuple(args.feature_layers) or None
    for spec in args.speculation:
        c = count_step(spec, args.layers, fl, args.context, args.fast_path)
        total = sum(c.by_site.values())
        print(f"{spec}: {total} kernels per step")
        if args.by_line:
            for site, n in c.by_site.most_common(args.top):
                print(f"  {n:5d}  {site}")
            print("  by op:", ", ".join(f"{op} {n}" for op, n in c.by_op.most_common(25)))


if __name__ == "__main__":
    main()
