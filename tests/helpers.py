"""Tiny random checkpoints written the way real ones are (transformers' save_pretrained; EAGLE layout), and
`compile_for_sm90` (Triton kernels compiled for the H200 without a GPU)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from eyas.config import ModelConfig
from eyas.loader.eagle import load_draft, save_draft
from eyas.models.eagle import EagleDraft


# Tests that run Triton kernels on CPU tensors (CPU models with `use_triton` or the fused path, kernels fed CPU
# tensors): only the interpreter takes those, which conftest.py turns on where there is no GPU (CI). On a GPU machine,
# where Triton compiles, they would fail on their own tensors' device; the compiled kernels have their own GPU tests.
NO_CPU_TRITON = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
INTERPRETED_ONLY_REASON = ("runs Triton on CPU tensors, which only the interpreter takes (TRITON_INTERPRET=1, set by "
                           "conftest.py where there is no GPU); the compiled kernels have their own GPU tests")
interpreted_only = pytest.mark.skipif(NO_CPU_TRITON, reason=INTERPRETED_ONLY_REASON)

# `max_model_len` of the tiny models' engines on the interpreted Triton path, whose cost is per program launched. The
# attention's prefix split count follows the context bucket (`ModelRunner.context_bound`): 512 at the tiny models'
# 512 positions, cut into 8 splits of which these short contexts fill one. At 128 the block table is 144 tokens wide,
# cut into 2 splits: still a prefix in several splits that the reduction merges, with a third of the split tree
# kernel's programs (9 to 3 a kv head: the splits and the suffix) and a quarter of the prefix kernel's.
SHORT_CONTEXT = 128


def tiny_llama_config(vocab=40, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=None, tie=False,
                      rope_scaling=None, max_pos=512, **kw):
    from transformers import LlamaConfig
    cfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
               tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
               pad_token_id=None, **kw)
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
        cfg["rope_theta"] = 500000.0
    return LlamaConfig(**cfg)


def write_tiny_llama(path: Path, seed=0, **kw) -> Path:
    """A random Llama checkpoint via transformers' save_pretrained; returns the directory."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kw)).float()
    with torch.no_grad():  # larger weights than HF's init, so that outputs depend visibly on the input
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 / p.shape[1] ** 0.5 * 4)
    model.save_pretrained(path)
    return Path(path)


def write_tiny_chat_model(path: Path, tok, **kw) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (an HF directory); `kw`: its shape, in place of
    `write_tiny_llama`'s defaults."""
    write_tiny_llama(path, **{"vocab": tok.vocab_size, "hidden": 32, "layers": 1, "heads": 4, "kv_heads": 2, **kw})
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    return path


def write_random_draft(path: Path, target_dir: Path, layers=1, seed=1, scale=1.0) -> Path:
    """A random EAGLE-1 draft matching a target checkpoint's shapes."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    draft = EagleDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, scale / p.shape[1] ** 0.5)
    return save_draft(draft, path, dtype=torch.float32)


def noting_batches(llm) -> list[int]:
    """Make every step of `llm`'s engine note the size of its running batch first; returns the list it appends to."""
    step, batches = llm.engine.step, []

    def noting_step():
        batches.append(len(llm.engine.scheduler.running))
        return step()

    llm.engine.step = noting_step
    return batches


def eagle3_weights(target_dir: Path, draft_vocab: int | None = None, seed=3, theta: float = 10000.0,
                   aux_ids: list[int] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of a random EAGLE-3 draft for a target checkpoint, in SafeAILab's layout (`fc`,
    `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`): written by hand from the layout's description, not by eyas.
    `draft_vocab`: the draft proposes that many tokens, every other one of the target's (d2t), else all of them.
    `aux_ids`: the target layers whose inputs it reads (vLLM's `eagle_aux_hidden_state_layer_ids`; default: none
    stated, so (2, L//2, L-3))."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    H, I, V = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    heads, kv = raw["num_attention_heads"], raw["num_key_value_heads"]
    D = H // heads
    vd = draft_vocab or V
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    state = {"fc.weight": w(H, len(aux_ids or (0, 0, 0)) * H), "norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
             "lm_head.weight": w(vd, H) * 3,
             "midlayer.self_attn.q_proj.weight": w(heads * D, 2 * H) * 2,
             "midlayer.self_attn.k_proj.weight": w(kv * D, 2 * H) * 2,
             "midlayer.self_attn.v_proj.weight": w(kv * D, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, heads * D),
             "midlayer.mlp.gate_proj.weight": w(I, H), "midlayer.mlp.up_proj.weight": w(I, H),
             "midlayer.mlp.down_proj.weight": w(H, I)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        state[f"midlayer.{norm}.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
    used = torch.arange(0, V, 2)[:vd] if vd < V else torch.arange(V)
    state["d2t"] = used - torch.arange(vd)  # target id = draft id + d2t[draft id]
    state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
              "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1,
              "rms_norm_eps": raw.get("rms_norm_eps", 1e-6), "vocab_size": V, "draft_vocab_size": vd,
              "max_position_embeddings": 2048, "rope_theta": theta, "tie_word_embeddings": False}
    if aux_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    return config, state


def write_checkpoint(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """A checkpoint directory: config.json + model.safetensors."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def write_eagle3_draft(path: Path, target_dir: Path, **kw) -> Path:
    """`eagle3_weights` written as a checkpoint directory."""
    return write_checkpoint(path, *eagle3_weights(target_dir, **kw))


def write_mirror_and_random(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{"mirror": the mirror pair, "random": its target with a random draft}: a draft that accepts long paths but
    reads only token embeddings, and one whose every output depends on the features it reads."""
    target, mirror = write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)
    return {"mirror": (target, mirror), "random": (target, write_random_draft(tmp_path_factory.mktemp("r"), target))}


def write_mirror_pair(path: Path, vocab=24, layers=2, seed=0) -> tuple[Path, Path]:
    """A tiny target and a draft that nearly copies it, so that long draft paths are accepted.

    The target's embedding rows have RMS 1 and all its norm weights are 1, so its first input norm is (almost)
    the identity and its final norm only rescales. The draft's fc passes the token embedding through, and its
    layers are the target's: the draft is the target minus the first token of the context, which greedy
    verification accepts most of the time.
    """
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(tiny_llama_config(vocab=vocab, hidden=32, layers=layers, heads=4, kv_heads=2)).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
            else:
                p.fill_(1.0)  # norm weights
        e = hf.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    target_dir = Path(path) / "target"
    hf.save_pretrained(target_dir)
    cfg = ModelConfig.from_hf(json.loads((target_dir / "config.json").read_text()))
    draft = EagleDraft(cfg)
    with torch.no_grad():
        H = cfg.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, :H] = torch.eye(H)
        sd = hf.state_dict()
        for name, p in draft.named_parameters():
            if name.startswith("layers."):
                p.copy_(sd["model." + name])
    return target_dir, save_draft(draft, Path(path) / "draft", dtype=torch.float32)


# ---- guided decoding's tiny world: a byte-level BPE and the mirror pair over it ------------------------------------

END = "<|end|>"
SEP = "<|sep|>"  # a special token that is not a stop token
MERGES = [("a", "b"), ("ab", "c"), ("b", "a"), ("Ġ", "y"), ("Ġy", "e"), ("Ġye", "s"), ("n", "o"), ("{", "\""),
          ("\"", ":"), ("1", "2")]


def tiny_tokenizer():
    """A byte-level BPE of 256 bytes, ten merges and one special end token: a real tokenizer's kind, small enough
    for a tiny model and for enumerating a grammar's token paths."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from eyas.loader.tokenizer import Tokenizer, _bytes_to_unicode
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([END, SEP])
    return Tokenizer(backend, eos_token=END)


THINK, UNTHINK = "<think>", "</think>"


def think_tokenizer():
    """`tiny_tokenizer` with a reasoning model's `<think>` and `</think>`: added tokens, not special (their text
    stays in the output, as DeepSeek-R1's and Qwen3's do)."""
    from tokenizers import AddedToken
    tok = tiny_tokenizer()
    tok.backend.add_tokens([AddedToken(THINK, special=False), AddedToken(UNTHINK, special=False)])
    return tok


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


def write_guided_mirror(d):
    """(target dir, draft dir, tokenizer): the mirror pair (a draft that nearly copies its target, so long paths
    are accepted) over the tiny tokenizer, with a chat template."""
    tok = tiny_tokenizer()
    target, draft = write_mirror_pair(d, vocab=tok.vocab_size, layers=2)
    tok.backend.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": END, "chat_template": CHAT_TEMPLATE}))
    return target, draft, tok


def dense_kv(model_layers, rope, run):
    """K (after RoPE) and V of every layer of a dense forward, captured with hooks on k_proj / v_proj."""
    ks, vs, hooks = {}, {}, []
    for i, layer in enumerate(model_layers):
        a = layer.self_attn
        hooks.append(a.k_proj.register_forward_hook(lambda m, inp, out, i=i: ks.__setitem__(i, out)))
        hooks.append(a.v_proj.register_forward_hook(lambda m, inp, out, i=i: vs.__setitem__(i, out)))
    positions = run()
    for h in hooks:
        h.remove()
    out = []
    for i, layer in enumerate(model_layers):
        a = layer.self_attn
        k = ks[i].view(1, -1, a.n_kv, a.head_dim)
        _, k = rope(positions, k.new_zeros(1, k.shape[1], a.n_heads, a.head_dim), k)
        out.append((k[0], vs[i].view(-1, a.n_kv, a.head_dim)))
    return out


def paged_kv(cache, layer, block_table, n, block_size):
    """The K and V of positions 0..n-1 of one layer of a paged cache, through a sequence's block table."""
    slots = [block_table[p // block_size] * block_size + p % block_size for p in range(n)]
    flat_k = cache.k[layer].reshape(-1, *cache.k.shape[3:])
    flat_v = cache.v[layer].reshape(-1, *cache.v.shape[3:])
    return flat_k[slots], flat_v[slots]


def assert_draft_state(engine, seq, target, draft, read: torch.Tensor, block_size: int) -> None:
    """The draft's state of a running `seq` holds exactly its committed history: with d = seq.num_draft_cached and
    n = seq.num_cached, the draft KV the pairs (x_{t+1}, read_t) for t < d, and the sequence's slot of the
    hidden-state buffer read_t for t = d..n-1 (what the next catch-up reads). `read` [1, n, H]: the target's
    features of the committed tokens as the draft reads them (`draft.read_features`), from a dense forward."""
    n, d = seq.num_cached, seq.num_draft_cached
    torch.testing.assert_close(engine.runner.draft_hidden[seq.slot, : n - d], read[0, d:n], atol=1e-5, rtol=1e-5)
    dids, dpos = torch.tensor([seq.token_ids[1: d + 1]]), torch.arange(d)[None]
    ref = dense_kv(draft.layers, draft.rope, lambda: (draft(target.embed(dids), read[:, :d], dpos), dpos)[1])
    for layer, (k, v) in enumerate(ref):
        pk, pv = paged_kv(engine.runner.draft_cache, layer, seq.block_table, d, block_size)
        torch.testing.assert_close(pk, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pv, v, atol=1e-5, rtol=1e-5)


def load_mirror_pair(paths: tuple[Path, Path]):
    """`write_mirror_pair`'s target and draft as modules (CPU, float32): (target, draft)."""
    from eyas.loader.eagle import load_draft
    from eyas.loader.resolve import load_target
    target, _ = load_target(str(paths[0]), "cpu", "float32")
    return target, load_draft(str(paths[1]), target)


def feature_draft_from(eagle1_dir: Path, target, out: Path, feature_layers=(0,), noise: float = 0.0,
                       seed: int = 0) -> Path:
    """A feature-layer draft with the fc/layers of an EAGLE-1 checkpoint and `fuse` at the identity (plus, with
    `noise`, random weights on the lower layers' blocks)."""
    e1 = load_draft(eagle1_dir, target)
    cfg = dataclasses.replace(e1.config, feature_layers=tuple(feature_layers))
    d = EagleDraft(cfg)
    d.load_state_dict({k: v for k, v in e1.state_dict().items() if not k.startswith("rope.")}, strict=False)
    d.init_fuse_identity()
    if noise:
        H = cfg.hidden_size
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w = d.fuse.weight
            w[:, :-H] = torch.randn(w[:, :-H].shape, generator=g) * noise / H ** 0.5
    return save_draft(d, out, dtype=torch.float32)


def write_distill_setup(root: Path, vocab: int = 64, prompt: int = 8, seq: int = 64, n: int = 240):
    """A tiny target whose layers are scaled down (its predictions then depend mostly on the current token, which a
    short run can learn), and `n` sequences sampled from the target itself, stored pre-tokenised: `prompt` prompt
    tokens, then the target's own continuation up to `seq` tokens (the loss mask). Returns (target dir, data file,
    the loaded target)."""
    import gzip
    from safetensors.torch import load_file, save_file
    from eyas.loader.resolve import load_target
    tdir = write_tiny_llama(Path(root) / "target", vocab=vocab, hidden=64, layers=2, heads=4, kv_heads=2)
    state = load_file(str(tdir / "model.safetensors"))
    for k, v in state.items():
        if ".layers." in k and v.dim() == 2:
            state[k] = (v * 0.3).contiguous()
    save_file(state, str(tdir / "model.safetensors"), metadata={"format": "pt"})
    target, _ = load_target(str(tdir), "cpu", "float32")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, prompt), generator=g)
    with torch.no_grad():
        for _ in range(seq - prompt):
            pos = torch.arange(ids.shape[1])[None].expand(n, -1)
            probs = target.compute_logits(target(ids, pos)[:, -1]).softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
    data = Path(root) / "data.jsonl.gz"
    with gzip.open(data, "wt") as f:
        for r in ids.tolist():
            f.write(json.dumps({"input_ids": r, "loss_mask": [0] * prompt + [1] * (seq - prompt)}) + "\n")
    return tdir, data, target


_COMPILE_SM90 = r"""
import importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
results = []
for mod, name, sig, constexprs, options in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(mod), name)
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": options.get("num_warps", 4),
                                           "num_stages": options.get("num_stages", 3)})
    except Exception as e:
        results.append({"error": f"{mod}.{name} {constexprs}: {type(e).__name__}: {str(e)[-600:]}"})
        continue
    usage = None
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
    ptx = [l.strip() for l in compiled.asm["ptx"].splitlines()]
    gdc = [l.split(".")[1].split(";")[0].strip() for l in ptx if l.startswith("griddepcontrol.")]
    waits = [i for i, l in enumerate(ptx) if l.startswith("griddepcontrol.wait")]
    loads = sum(1 for l in ptx[:waits[0]] if re.match(r"(@!?%p\w+\s+)?(ld\.global|cp\.async)", l)) if waits else None
    results.append({"error": None, "usage": usage, "shared": compiled.metadata.shared, "gdc": gdc,
                    "loads_before_wait": loads})
print(json.dumps(results))
"""


# SmolLM2's tile launches in a verify pass (tile_variant's keywords): qkv + RoPE into a stash (480 pairs), o,
# gate/up (SwiGLU's 1536 pairs), down. tools/diag/tile_regs.py compiles these too.
SMOLLM2_TILE_SHAPES = {"qkv_rope": dict(N=480, K=576, pair=2, norm=True, res=False, hd=32),
                       "gu": dict(N=1536, K=576, pair=1, norm=True, res=False, hd=1),
                       "o": dict(N=576, K=576, pair=0, norm=False, res=True, hd=1),
                       "down": dict(N=576, K=1536, pair=0, norm=False, res=True, hd=1)}


def tile_variant(M: int, cfg, dtype, N: int, K: int, pair: int = 0, norm: bool = False, res: bool = False,
                 hd: int = 1, pdl: bool = True):
    """A `compile_for_sm90` variant of decode_linear's tile kernels: the kernel, constexprs and options its own
    launch takes for M rows of x [M, K] against weight [N, K] (pair: 0 plain, 1 SwiGLU, 2 RoPE with head dim hd; N
    counts pairs then) in `dtype`, with PDL."""
    from eyas.kernels.decode_linear import _epilogue_constexprs, _tile_launch
    consts = _epilogue_constexprs(cfg, pair, hd, norm=norm, res=res, has_dst=False, use_gdc=pdl)
    kernel, consts, options = _tile_launch(cfg, M, K, dtype, consts)
    sig = _linear_signature(dtype)
    sig.update({k: "constexpr" for k in consts})
    return ("eyas.kernels.decode_linear", kernel.__name__, sig, consts, options)


def _linear_signature(dtype) -> dict:
    """The runtime arguments decode_linear's kernels share (tensors in `dtype`), in their order."""
    t = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    sig = {p: t for p in ("X", "W", "NORM_W", "RES", "OUT")}
    sig.update({p: "i32" for p in ("M", "N", "K")})
    sig.update(eps="fp32", stride_x="i32", stride_r="i32", stride_o="i32", COS="*fp32", SIN="*fp32", POS="*i64",
               DST="*i64", KC=t, VC=t, stride_cos="i32", Q_ROWS="i32", QK_ROWS="i32", KV_ROW="i32",
               SEQ_Q="i32", SEQ_ROWS="i32", ROW_OFF="i32")
    return sig


def register_variant(M: int, cfg, dtype, N: int, K: int, pair: int = 0, norm: bool = False, res: bool = False,
                     hd: int = 1, pdl: bool = True):
    """`tile_variant` for decode_linear's register kernel (`_decode_linear_kernel`, a DecodeLinearConfig `cfg`),
    as its launch in `decode_linear` takes it (bf16 or float32 weights, no FP8 scale)."""
    from eyas.kernels.decode_linear import _epilogue_constexprs, _register_constexprs
    consts = _register_constexprs(cfg, M, K, _epilogue_constexprs(cfg, pair, hd, norm=norm, res=res, has_dst=False,
                                                                  use_gdc=pdl), has_scale=False)
    sig = _linear_signature(dtype)
    sig["SCALE"] = sig["X"]  # (no scale: the launch passes x there)
    sig.update({k: "constexpr" for k in consts})
    return ("eyas.kernels.decode_linear", "_decode_linear_kernel", sig, consts, {"num_warps": cfg.num_warps})


def compile_for_sm90(variants) -> list[dict]:
    """Compile Triton kernels for sm_90 (the H200) without a GPU, with the ptxas inside the triton wheel, in a fresh
    process: after interpreted runs (TRITON_INTERPRET=1) the `tl` module of this one is the interpreter's. `variants`:
    (module, kernel name, signature, constexprs, options) each. Returns per variant {"error": text or None, "usage":
    cuobjdump's resource usage (registers, stack, static shared memory) or None, "shared": the launch's dynamic
    shared memory in bytes, "gdc": the PTX's griddepcontrol instructions in text order ("launch_dependents",
    "wait"), "loads_before_wait": the global loads (ld.global, cp.async, predicated or not) the PTX text has before
    its first wait, None without one}."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run([sys.executable, "-c", _COMPILE_SM90], input=json.dumps([list(v) for v in variants]),
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app):
        import socket
        import threading
        import time

        import uvicorn
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    @property
    def engine(self):
        return self.app.state.server.engine

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {"name{label=value,...}": value}, parsed by prometheus_client."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
        return out

    def wait_idle(self, timeout=60.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and the KV cache is empty; return that scrape."""
        import time
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["eyas:kv_cache_used_blocks{}"] == 0 and m["eyas:num_requests_running{}"] == 0
                    and m["eyas:num_requests_waiting{}"] == 0):
                return m
            assert time.monotonic() < deadline, f"the server did not go idle: {m}"
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)

    def streams_left_midway(self, body: dict, n: int):
        """A context: `n` streamed /v1/completions requests of `body`, each read until two chunks of generated text
        came; on exit the clients leave mid-stream (their connections close)."""
        import contextlib

        import httpx

        @contextlib.contextmanager
        def opened():
            with httpx.Client(timeout=60) as http, contextlib.ExitStack() as stack:
                readers = []
                for _ in range(n):
                    r = stack.enter_context(http.stream("POST", self.url + "/v1/completions", json=body))
                    assert r.status_code == 200
                    lines = r.iter_lines()
                    readers.append(lines)  # keep the iterator alive: collecting it would close the response
                    got = 0
                    for line in lines:
                        got += line.startswith("data: {")
                        if got == 2:
                            break
                yield

        return opened()


def live_children(pid: int) -> list[int]:
    """Live descendants of `pid` (from /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids + [g for k in kids for g in live_children(k)]


def start_serve(args: list[str], timeout: float = 90.0, group: bool = False):
    """`eyas serve ARGS` (served as "tiny", float32 on the CPU) on a free port, up and healthy: (process, port). With
    `group`, in a process group of its own (a terminal's Ctrl-C reaches the whole group). Its output is piped (read
    it once it has ended)."""
    import socket
    import subprocess
    import sys
    import time

    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "eyas.cli", "serve", *args, "--served-model-name", "tiny", "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=group)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, 9) if group else proc.kill()
            raise AssertionError(f"eyas serve {' '.join(args)} did not come up in {timeout} s")
        time.sleep(0.2)


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    """Until none of `pids` lives (zombies, which only wait for their parent to read them, count as gone)."""
    import time
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{k}").exists() and "Z" not in Path(f"/proc/{k}/stat").read_text().split()[2]
              for k in pids):
        assert time.monotonic() < deadline, "a process outlived the server"
        time.sleep(0.1)


def stop_cleanly(proc, how: str, timeout: float = 60.0) -> None:
    """Stop a `start_serve(..., group=True)` server: "ctrl-c" (SIGINT to its process group, as a terminal sends it)
    or "sigterm" (to the server alone: `kill`, `docker stop`). It must exit 0, and no one complains (no traceback,
    no leaked semaphore)."""
    import signal
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout) == 0
    out = proc.stdout.read().decode()
    assert "Traceback" not in out and "leaked" not in out, out
