"""Where a draft-training step's time goes on the GPU, with random SmolLM2-shape weights (no model needed):
    PYTHONPATH=. python3 tools/diag/train_step_profile.py
Used on the H200 on 2026-11-29 (docs/draft-training.md, "The loop"): 51.0 ms per 8 x 2048-token step."""
import time
import numpy as np, torch
from torch.profiler import profile, ProfilerActivity
from eyas.bench.shapes import random_target
from eyas.train.trainer import make_draft, draft_inputs, _noise, _autocast
from eyas.train.loss import distill_loss

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = True
tgt = random_target("smollm2-shape", dev, torch.bfloat16)
d = make_draft(tgt, 1).to(dev, torch.float32).train()
opt = torch.optim.AdamW(d.parameters(), lr=1e-4)
B, T = 8, 2048
g = torch.Generator(device=dev).manual_seed(0)
ids = torch.randint(0, 49152, (B, T), device=dev)
amask = torch.rand(B, T, device=dev) < 0.6

def step(parts=None):
    ts = [time.perf_counter()]
    emb, feats, pos, tgt_h, lmask = draft_inputs(tgt, ids, amask)
    if parts is not None: torch.cuda.synchronize(); ts.append(time.perf_counter())
    feats = _noise(feats, "uniform", 0.2, g)
    tgt_sel = tgt_h[lmask]
    with torch.no_grad():
        tlog = tgt.compute_logits(tgt_sel)
    if parts is not None: torch.cuda.synchronize(); ts.append(time.perf_counter())
    with _autocast(dev, True):
        out = d(emb, feats, pos)
        o_sel = out[lmask]
        dlog = tgt.compute_logits(o_sel.to(tgt_h.dtype))
    if parts is not None: torch.cuda.synchronize(); ts.append(time.perf_counter())
    lo = distill_loss(o_sel, tgt_sel, dlog, tlog, None, 0.1, 1.0)
    if parts is not None: torch.cuda.synchronize(); ts.append(time.perf_counter())
    opt.zero_grad(set_to_none=True)
    lo.loss.backward()
    if parts is not None: torch.cuda.synchronize(); ts.append(time.perf_counter())
    torch.nn.utils.clip_grad_norm_(d.parameters(), 0.5)
    opt.step()
    float(lo.loss.detach()); float(lo.ce); float(lo.correct)
    if parts is not None:
        torch.cuda.synchronize(); ts.append(time.perf_counter())
        parts.append(np.diff(ts) * 1000)

for _ in range(3): step()
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(10): step()
torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / 10
print(f"train step B={B} T={T}: {dt*1000:.1f} ms -> {B*T/dt:,.0f} tok/s")
parts = []
for _ in range(5): step(parts)
print("parts ms [target, tlogits, draft fwd+logits, loss, backward, opt+sync]:", np.round(np.mean(parts, 0), 1))
with torch.no_grad():
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    for name, fn in [("target fwd", lambda: tgt(ids, pos))]:
        for _ in range(2): fn()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(5): fn()
        torch.cuda.synchronize(); print(name, f"{(time.perf_counter()-t0)/5*1000:.1f} ms")
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(3): step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
