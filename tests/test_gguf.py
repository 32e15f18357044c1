"""The GGUF loader on files written here the way llama.cpp's converter writes them (Q/K rows permuted, tensors in
F32, F16, Q8_0 or Q4_1): the weights come back in HF layout, and the logits equal HF transformers' on the source
checkpoint."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eyas.loader import load_target
from helpers import write_tiny_llama

GGUF = pytest.importorskip("gguf")
V, H, I, L, HEADS, KV = 64, 64, 128, 2, 4, 2
NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permutation of Q/K rows (HF half-split RoPE -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_dir, qtype_name: str, arch: str = "llama", pre: str = "gpt-2"):
    """`arch` "qwen2": as llama.cpp's converter writes a Qwen2 model (q, k, v biases; no Q/K permutation)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    qtype = GGMLQuantizationType[qtype_name]
    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    w = GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(V)
    if cfg.get("head_dim") and cfg["head_dim"] != H // HEADS:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([chr(ord("A") + i) if i < 26 else chr(ord("a") + i - 26) if i < 52 else str(i - 52)
                      for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def put(name, t: torch.Tensor, quantized: bool):
        a = t.float().numpy()
        if not quantized or qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"], True)
    put("output_norm.weight", sd["model.norm.weight"], False)
    put("output.weight", sd["lm_head.weight"], True)
    for i in range(L):
        for hf_name, gg in NAMES.items():
            sub = "self_attn" if hf_name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"model.layers.{i}.{hf_name}.weight" if "layernorm" in hf_name else \
                f"model.layers.{i}.{sub}.{hf_name}.weight"
            t = sd[key]
            if hf_name == "q_proj" and arch == "llama":
                t = torch.from_numpy(llama_cpp_permute(t.numpy(), HEADS))
            if hf_name == "k_proj" and arch == "llama":
                t = torch.from_numpy(llama_cpp_permute(t.numpy(), KV))
            put(f"blk.{i}.{gg}.weight", t, "layernorm" not in hf_name)
            if key.replace(".weight", ".bias") in sd:
                put(f"blk.{i}.{gg}.bias", sd[key.replace(".weight", ".bias")], False)
        for qk in ("q", "k"):  # Qwen3's per-head norms
            if f"model.layers.{i}.self_attn.{qk}_norm.weight" in sd:
                put(f"blk.{i}.attn_{qk}_norm.weight", sd[f"model.layers.{i}.self_attn.{qk}_norm.weight"], False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("g") / "m", vocab=V, hidden=H, heads=HEADS, kv_heads=KV,
                            layers=L, tie=False)


@pytest.mark.parametrize("qtype,tol", [("F32", 0.0), ("F16", 1e-3), ("Q8_0", 1 / 127), ("Q4_1", 1 / 12)])
def test_gguf_weights_come_back_in_hf_layout(tmp_path, hf_dir, qtype, tol):
    model, tok = load_target(str(write_gguf(tmp_path / f"m-{qtype}.gguf", hf_dir, qtype)), "cpu", "float32")
    ref = load_file(str(hf_dir / "model.safetensors"))
    for name, p in model.state_dict().items():
        if name.startswith("rope."):
            continue
        r = ref[name]
        # per-row bound: a block quantiser errs by at most half a step (Q8_0: absmax/127; Q4_1: range/30 with
        # float16 scales and minima, bounded here by absmax/12)
        bound = tol * r.abs().amax(dim=-1, keepdim=True) + 1e-7 if r.dim() == 2 else 1e-7
        assert (p - r).abs().le(bound).all(), name
    assert tok is not None and tok.vocab_size == V


def test_gguf_f32_logits_equal_hf(tmp_path, hf_dir):
    from transformers import LlamaForCausalLM
    model, _ = load_target(str(write_gguf(tmp_path / "m.gguf", hf_dir, "F32")), "cpu", "float32")
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    out = model.compute_logits(model(ids, torch.arange(30)[None]))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_qwen2_gguf_logits_equal_hf(tmp_path):
    """A Qwen2 GGUF (biases on q, k and v; rows as the converter leaves them, unpermuted; the "qwen2"
    pre-tokenizer, which splits digits one by one) equals transformers' Qwen2ForCausalLM on the source checkpoint."""
    from transformers import Qwen2ForCausalLM
    from test_model_hf import write_tiny_qwen2
    src = write_tiny_qwen2(tmp_path / "q", vocab=V, hidden=H, heads=HEADS, kv_heads=KV, layers=L, tie=False)
    model, tok = load_target(str(write_gguf(tmp_path / "q.gguf", src, "F32", arch="qwen2", pre="qwen2")), "cpu",
                             "float32")
    assert model.config.qkv_bias and model.model.layers[0].self_attn.o_proj.bias is None
    hf = Qwen2ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(model.compute_logits(model(ids, torch.arange(30)[None])), ref, atol=1e-4, rtol=0)
    assert tok.backend.pre_tokenizer.pre_tokenize_str("a 123")[-3:] == [("1", (2, 3)), ("2", (3, 4)), ("3", (4, 5))]


def test_qwen3_gguf_logits_equal_hf(tmp_path):
    """A Qwen3 GGUF (per-head q and k norms, a head size given by key_length, unpermuted rows) equals transformers'
    Qwen3ForCausalLM on the source checkpoint."""
    from transformers import Qwen3ForCausalLM
    from test_model_hf import write_tiny_qwen3
    src = write_tiny_qwen3(tmp_path / "q", vocab=V, hidden=H, heads=HEADS, kv_heads=KV, head_dim=24, layers=L,
                           tie=False)
    model, _ = load_target(str(write_gguf(tmp_path / "q.gguf", src, "F32", arch="qwen3", pre="qwen2")), "cpu",
                           "float32")
    assert model.config.qk_norm and model.config.head_dim == 24
    hf = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(model.compute_logits(model(ids, torch.arange(30)[None])), ref, atol=1e-4, rtol=0)


def test_unsupported_tensor_type_is_named(tmp_path, hf_dir):
    with pytest.raises(ValueError, match="Q4_0"):
        load_target(str(write_gguf(tmp_path / "m.gguf", hf_dir, "Q4_0")), "cpu", "float32")
