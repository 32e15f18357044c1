# Session 43 (issue #5): the prefix's first key tile loaded before the PDL wait (`eyas.kernels.tree_attention.
# EARLY_PREFIX`, on by default; the variant `off` turns it off). No staging:
#   bash tools/device/early_prefix_ab.sh      (STAGE=1 also copies .stage/a's third to /root/stage, as call 1 of three)
# 1. the early tiles' tests compiled on the GPU (TESTS_K: their -k, `early`), and the registers and spills of the
#    prefix kernels' launches in both modes;
# 2. smollm2-shape (run N A's bf16 rank paths replayed, batch 1, 8 x 64): plain and the default tree, off / on
#    alternated (ORDER);
# 3. the 8B shape (ab_lib's L8B rows, batch 1, 16 x 64): plain and `chain:3`, off / on alternated.
set -u
source tools/device/ab_lib.sh
begin early_prefix
[ "${STAGE:-0}" = 1 ] && mkdir -p /root/stage && cp .stage/a/part_aa /root/stage/
echo "== gpu tests [t=$(el)]"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "${TESTS_K:-early}" 2>&1 | tail -n 2
python3 - <<'PY'
import torch
import eyas.kernels.tree_attention as ta
from eyas.kernels import paged_prefix_attention, split_tree_attention_triton
dev = "cuda"
def case(KVH, G, D, Q, ctx=300, page=16):
    B = 1
    nb = 64
    kc = torch.randn(nb, page, KVH, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.arange(1, 1 + (ctx + page - 1) // page + 1, device=dev)[None]
    cl = torch.tensor([ctx], device=dev)
    q = torch.randn(B, Q, KVH * G, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, Q, KVH, D, device=dev, dtype=torch.bfloat16)
    mask = torch.ones(B, Q, Q, dtype=torch.bool, device=dev).tril()
    return q, kn, kn.clone(), kc, vc, bt, cl, mask
def compiled(fn):
    return {id(k): k for cache in fn.device_caches.values() for k in cache[0].values()}
def report(label, fn, call):
    before = compiled(fn)
    call()
    torch.cuda.synchronize()
    for i, k in compiled(fn).items():
        if i not in before:
            k._init_handles()
            print(label, fn.__name__, "regs", k.n_regs, "spills", k.n_spills, flush=True)
for name, (KVH, G, D) in {"smollm2": (3, 3, 64), "8b": (8, 4, 128)}.items():
    for early in (None, 1):
        q, kn, vn, kc, vc, bt, cl, mask = case(KVH, G, D, 1)
        report(f"{name} plain early={early}", ta._paged_prefix_kernel, lambda: paged_prefix_attention(
            q, kc, vc, bt, cl, 0.1, max_context_len=512, out_dtype=torch.bfloat16, pdl=True, early=early))
    for early in (None, 0):
        q, kn, vn, kc, vc, bt, cl, mask = case(KVH, G, D, 49 if name == "smollm2" else 4)
        report(f"{name} verify early={early}", ta._split_tree_kernel, lambda: split_tree_attention_triton(
            q, kn, vn, kc, vc, bt, cl, mask, 0.1, max_context_len=512, out_dtype=torch.bfloat16, pdl=True,
            early=early))
PY
echo "== smollm2-shape [t=$(el)]"
off="m.EARLY_PREFIX = False"
for v in ${ORDER:-off on off on}; do
  if [ $v = on ]; then line="pass"; else line="$off"; fi
  s2_run s2_${v}_$(el) "$line"
done
echo "== 8B shape [t=$(el)]"
for v in ${ORDER8:-off on off on}; do
  if [ $v = on ]; then line="pass"; else line="$off"; fi
  switch_run l8_${v}_$(el) eyas.kernels.tree_attention "$line" $L8B --batch-sizes 1 --num-prompts 16 \
    --max-tokens 64 --modes plain,chain:3
done
echo "== rows [t=$(el)]"
latency_rows
(cd $OUT && tar czf rows.tar.gz s2_* l8_* && rm -rf s2_* l8_*)
