"""Does a chain of fused, PDL-launched one-row linears beat cuBLAS plus small kernels? (GPU only; sm_90.)

    PYTHONPATH=. python3 tools/diag/decode_chain_bench.py --out /tmp/chain.json

A synthetic Llama-3.1-8B batch-1 forward of distinct bf16 weights (32 layers of qkv, o, gate_up, down, and the
128k head: 15.0 GB, so L2 holds none of them between forwards), captured in one CUDA graph and replayed; ms per
forward. The attention of each layer is stood in for by one tiny kernel (q copied to the attention output), so the
chain's data dependencies are those of the real step; its own cost (~0.33 ms in the real step: RoPE + K/V store,
prefix attention, split reduction) comes on top in every variant alike.

* `cublas gemms`: the five linears of each layer and the head as F.linear, nothing else (what the weights cost at
  cuBLAS's bandwidth, with its split-K reductions);
* `cublas + small kernels`: what the engine's fused path launches today around those GEMMs (add + RMSNorm,
  SwiGLU, the residual adds folded into the norms);
* `decode_linear`: eyas.kernels.decode_linear (norm prologue, SwiGLU / residual epilogues), ordinary launches;
* `decode_linear + PDL`: the same with programmatic dependent launch (the stand-in too).

`--per-kind` also times each linear kind alone: 32 launches on the 32 layers' weights, cuBLAS against
decode_linear with and without PDL, per config of `--configs` (BLOCKxWARPS).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eyas.kernels.decode_linear import (DecodeLinearConfig, decode_linear, decode_linear_reference,
                                        default_decode_config)
from eyas.kernels.fused_norm import add_rms_norm_triton
from eyas.kernels.swiglu import swiglu_triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from l2_prefetch_bench import time_graph  # noqa: E402

H, QKV, I, VOCAB, LAYERS = 4096, 6144, 14336, 128256, 32
KINDS = {"qkv": (QKV, H, False), "o": (H, H, False), "gu": (I, H, True), "down": (H, I, False),
         "head": (VOCAB, H, False)}  # kind -> (N, K, swiglu), the arguments of default_decode_config


@triton.jit
def _standin_kernel(SRC, DST, n, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n), mask=offs < n)


def standin(src, dst, pdl):
    kw = {"launch_pdl": True} if pdl else {}
    _standin_kernel[(triton.cdiv(H, 1024),)](src, dst, H, BLOCK=1024, USE_GDC=pdl, num_warps=4, **kw)


def make_weights(dev, layers):
    g = torch.Generator(device=dev).manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02)

    ws = [dict(qkv=w(QKV, H), o=w(H, H), gu=w(2 * I, H), down=w(H, I),
               n1=1 + 0.1 * torch.randn(H, device=dev, dtype=torch.bfloat16, generator=g),
               n2=1 + 0.1 * torch.randn(H, device=dev, dtype=torch.bfloat16, generator=g)) for _ in range(layers)]
    return ws, w(VOCAB, H), torch.ones(H, device=dev, dtype=torch.bfloat16)


def fwd_cublas_gemms(x, ws, head):
    h = x
    for L in ws:
        q = F.linear(h, L["qkv"])
        a = q[:, :H]
        h = F.linear(a, L["o"])
        gu = F.linear(h, L["gu"])
        h = F.linear(gu[:, :I], L["down"])
    return F.linear(h, head)


def fwd_cublas_ops(x, ws, head, fnorm, attn):
    hid, res = x, None
    for L in ws:
        h, res = add_rms_norm_triton(hid, res, L["n1"], 1e-5)
        q = F.linear(h, L["qkv"])
        standin(q, attn, False)
        a = F.linear(attn, L["o"])
        h, res = add_rms_norm_triton(a, res, L["n2"], 1e-5)
        gate, up = F.linear(h, L["gu"]).chunk(2, dim=-1)
        hid = F.linear(swiglu_triton(gate, up), L["down"])
    h, _ = add_rms_norm_triton(hid, res, fnorm, 1e-5)
    return F.linear(h, head)


def fwd_fused(x, ws, head, fnorm, attn, bufs, pdl, cfgs):
    r, q, act, logits = bufs
    r.copy_(x.view(-1))
    for L in ws:
        decode_linear(r, L["qkv"], norm_weight=L["n1"], out=q, pdl=pdl, config=cfgs.get("qkv"))
        standin(q, attn, pdl)
        decode_linear(attn, L["o"], residual=r, out=r, pdl=pdl, config=cfgs.get("o"))
        decode_linear(r, L["gu"], norm_weight=L["n2"], swiglu=True, out=act, pdl=pdl, config=cfgs.get("gu"))
        decode_linear(act, L["down"], residual=r, out=r, pdl=pdl, config=cfgs.get("down"))
    return decode_linear(r, head, norm_weight=fnorm, out=logits, pdl=pdl, config=cfgs.get("head"))


def layer_errors(L, r, a_in, pdl):
    """max |decode_linear - reference| for each kind of one layer's weights `L`, on inputs r [.., H] and a_in
    [.., I] (the rows of x: one, or several)."""
    checks = {
        "qkv+norm": (decode_linear(r, L["qkv"], norm_weight=L["n1"], pdl=pdl),
                     decode_linear_reference(r, L["qkv"], norm_weight=L["n1"])),
        "o+res": (decode_linear(r, L["o"], residual=r.clone(), pdl=pdl),
                  decode_linear_reference(r, L["o"], residual=r)),
        "gu+norm+swiglu": (decode_linear(r, L["gu"], norm_weight=L["n2"], swiglu=True, pdl=pdl),
                           decode_linear_reference(r, L["gu"], norm_weight=L["n2"], swiglu=True)),
        "down+res": (decode_linear(a_in, L["down"], residual=r.clone(), pdl=pdl),
                     decode_linear_reference(a_in, L["down"], residual=r)),
    }
    return {k: (a.float() - b.float()).abs().max().item() for k, (a, b) in checks.items()}


def time_fn(fn, reps):
    """ms per call of `fn`, captured in a CUDA graph after two warm-up calls (which compile the kernels)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_graph(g, reps)


def parse_cfg(text):
    """"BxW" or "BxW@trigger" -> DecodeLinearConfig."""
    text, _, trig = text.partition("@")
    b, w = text.split("x")
    return DecodeLinearConfig(BLOCK_N=int(b), num_warps=int(w), trigger=trig or "start")


def cfg_name(c):
    return f"{c.BLOCK_N}x{c.num_warps}@{c.trigger}"


def fits(cfg, K, swiglu):
    """No spills (sm_90 offline compiles): <= 128 weights a thread; SwiGLU needs a gate/up pair."""
    return cfg.BLOCK_N * triton.next_power_of_2(K) <= 128 * 32 * cfg.num_warps and (cfg.BLOCK_N >= 2 or not swiglu)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--per-kind", action="store_true")
    ap.add_argument("--configs", default="1x4,2x4,4x4,2x8,4x8,8x8",
                    help="BLOCKxWARPS configs for --per-kind (those that would spill are skipped)")
    ap.add_argument("--triggers", default="start,end", help="PDL trigger placements to time")
    ap.add_argument("--chain-configs", default="",
                    help="kind=BxW[@trigger],... for the chain (kinds qkv, o, gu, down, head); default: the defaults")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    ws, head, fnorm = make_weights(dev, args.layers)
    nbytes = sum(t.numel() * 2 for L in ws for k, t in L.items() if k in ("qkv", "o", "gu", "down")) + head.numel() * 2
    print(f"weights {nbytes / 1e9:.2f} GB in {time.time() - t0:.1f} s", flush=True)
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    attn = torch.empty(1, H, device=dev, dtype=torch.bfloat16)
    bufs = (torch.empty(H, device=dev, dtype=torch.bfloat16), torch.empty(QKV, device=dev, dtype=torch.bfloat16),
            torch.empty(I, device=dev, dtype=torch.bfloat16), torch.empty(VOCAB, device=dev, dtype=torch.bfloat16))
    cfgs = {k: parse_cfg(v) for k, v in (p.split("=") for p in args.chain_configs.split(",") if p)}
    triggers = [t for t in args.triggers.split(",") if t]
    result = {"gb": nbytes / 1e9, "layers": args.layers, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "chain_configs": args.chain_configs,
              "rows": [], "per_kind": []}

    # correctness of one layer's kinds against the reference, on the GPU
    result["max_abs_err"] = layer_errors(ws[0], torch.randn(H, device=dev, dtype=torch.bfloat16),
                                         torch.randn(I, device=dev, dtype=torch.bfloat16), True)
    print("max |decode_linear - reference|:", result["max_abs_err"], flush=True)

    def chain_row(name, fn):
        try:
            ms = time_fn(fn, args.reps)
            ms2 = time_fn(fn, args.reps)
            row = {"variant": name, "ms": min(ms, ms2), "ms_runs": [ms, ms2], "tb_s": nbytes / min(ms, ms2) / 1e9}
        except Exception as e:  # noqa: BLE001 - record and go on
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:500]}
        result["rows"].append(row)
        print(row, flush=True)

    chain_row("cublas gemms", lambda: fwd_cublas_gemms(x, ws, head))
    chain_row("cublas + small kernels", lambda: fwd_cublas_ops(x, ws, head, fnorm, attn))
    chain_row("decode_linear", lambda: fwd_fused(x, ws, head, fnorm, attn, bufs, False, cfgs))
    for t in triggers:
        tc = {k: replace(cfgs.get(k) or default_decode_config(*shape), trigger=t) for k, shape in KINDS.items()}
        chain_row(f"decode_linear + PDL@{t}", lambda tc=tc: fwd_fused(x, ws, head, fnorm, attn, bufs, True, tc))

    if args.per_kind:
        kinds = {"qkv": dict(norm=True), "o": dict(res=True), "gu": dict(norm=True, swiglu=True),
                 "down": dict(res=True)}
        xin = {"qkv": bufs[0], "o": attn.view(-1), "gu": bufs[0], "down": bufs[2]}
        outs = {"qkv": bufs[1], "o": bufs[0], "gu": bufs[2], "down": bufs[0]}
        best = {}  # mode -> kind -> (us, cfg)
        for kind, opt in kinds.items():
            kb = sum(L[kind].numel() * 2 for L in ws)

            def cub(kind=kind):
                for L in ws:
                    F.linear(xin[kind].view(1, -1), L[kind])
            ms = time_fn(cub, args.reps)
            rec = {"kind": kind, "cublas_us": ms * 1e3 / len(ws), "cublas_tb_s": kb / ms / 1e9}
            K = ws[0][kind].shape[1]
            for c in args.configs.split(","):
                for mode in ["none"] + triggers:
                    cfg = parse_cfg(c if mode == "none" else f"{c}@{mode}")
                    if not fits(cfg, K, opt.get("swiglu", False)):
                        continue
                    pdl = mode != "none"

                    def run(kind=kind, cfg=cfg, pdl=pdl):
                        for L in ws:
                            decode_linear(xin[kind], L[kind], norm_weight=L["n1"] if opt.get("norm") else None,
                                          residual=bufs[0] if opt.get("res") else None, swiglu=opt.get("swiglu", False),
                                          out=outs[kind], pdl=pdl, config=cfg)
                    key = f"{c}{'' if mode == 'none' else '+pdl@' + mode}"
                    try:
                        us = time_fn(run, args.reps) * 1e3 / len(ws)
                        rec[f"{key}_us"] = us
                        if us < best.setdefault(mode, {}).get(kind, (1e9,))[0]:
                            best[mode][kind] = (us, cfg)
                    except Exception as e:  # noqa: BLE001
                        rec[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
            result["per_kind"].append(rec)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
        # the chain again with each mode's best config per kind (the head keeps qkv's)
        for mode, per in best.items():
            bc = {k: c for k, (_, c) in per.items()}
            if "qkv" in bc:
                bc["head"] = bc["qkv"]
            name = f"decode_linear best per kind ({mode}): " + ",".join(f"{k}={cfg_name(c)}" for k, c in bc.items())
            chain_row(name, lambda bc=bc, mode=mode: fwd_fused(x, ws, head, fnorm, attn, bufs, mode != "none", bc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
