"""eyas's Llama equals HF transformers' LlamaForCausalLM loaded from the same checkpoint directory (1e-4, float32),
through the dense path and through the paged KV cache (chunked prefill, then token-by-token decoding)."""
import json

import pytest
import torch

from eyas.cache.kv_cache import KVCache
from eyas.layers.attention import MetaBuilder
from eyas.spec.drafter import causal_mask
from eyas.loader import load_target
from helpers import write_tiny_llama

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
CONFIGS = [
    dict(hidden=32, heads=4, kv_heads=4, tie=False),  # MHA, head dim 8
    dict(hidden=64, heads=4, kv_heads=2, tie=True),  # GQA 2, head dim 16, tied head
    dict(hidden=64, heads=8, kv_heads=1, tie=False, rope_scaling=LLAMA3_SCALING),  # MQA, llama3 rope
    dict(hidden=48, heads=4, kv_heads=2, head_dim=32, tie=True, rope_scaling=LLAMA3_SCALING),  # head_dim != H/heads
]


def hf_logits(path, ids):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def paged_logits(model, ids, chunk=5, block_size=4):
    """Chunked prefill through the paged cache, then one token at a time; logits at every position."""
    cfg = model.config
    cache = KVCache.allocate(cfg, cfg.num_hidden_layers, 64, block_size, torch.float32, "cpu")
    block_table = list(range(3, 3 + (len(ids) + block_size - 1) // block_size))[::-1]  # scattered, reversed
    out = []
    pos = 0
    while pos < len(ids):
        q = chunk if pos < 2 * chunk else 1
        q = min(q, len(ids) - pos)
        build = MetaBuilder(torch.tensor([block_table]), block_size, pos)
        positions = torch.arange(pos, pos + q)[None]
        meta = build(torch.tensor([pos]), causal_mask(torch.tensor([q]), q),
                     slot_mapping=build.slots(positions, torch.ones(1, q, dtype=torch.bool)))
        h = model(torch.tensor([ids[pos: pos + q]]), positions, meta, cache)
        out.append(model.compute_logits(h)[0])
        pos += q
    return torch.cat(out)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"h{c['hidden']}-q{c['heads']}-kv{c['kv_heads']}")
def test_logits_equal_hf(tmp_path, cfg):
    path = write_tiny_llama(tmp_path / "m", vocab=97, layers=3, max_pos=256, **cfg)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits(path, ids)
    model, tok = load_target(str(path), "cpu", "float32")
    assert tok is None
    dense = model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
    torch.testing.assert_close(dense, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(paged_logits(model, ids), ref, atol=1e-4, rtol=0)


def logits_equal_hf(path, hf_class, vocab=97):
    """Our model of the checkpoint at `path` against transformers' `hf_class` on 40 random tokens: dense and paged
    logits within 1e-4. Returns (the tokens, the HF model, ours)."""
    ids = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = hf_class.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model, _ = load_target(str(path), "cpu", "float32")
    dense = model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
    torch.testing.assert_close(dense, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(paged_logits(model, ids), ref, atol=1e-4, rtol=0)
    return ids, hf, model


def write_tiny_qwen2(path, vocab=97, hidden=64, heads=4, kv_heads=2, layers=3, tie=True, seed=0):
    """A random Qwen2 checkpoint (biases on q, k and v) via transformers' save_pretrained."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # larger weights than HF's init (and biases that are not 0)
        for p in model.parameters():
            p.normal_(0, 0.5 / p.shape[-1] ** 0.5 * 4 if p.dim() == 2 else 0.3)
    model.save_pretrained(path)
    return path


def test_qwen2_equals_hf(tmp_path):
    """A Qwen2 checkpoint (q, k, v biases, no o bias, tied head) equals transformers' Qwen2ForCausalLM, dense and
    paged; greedy speculative decoding equals plain decoding on it; a config that turns the sliding window on caps
    the context at the window."""
    from transformers import Qwen2ForCausalLM
    from eyas import LLM, SamplingParams
    from helpers import write_random_draft
    path = write_tiny_qwen2(tmp_path / "q")
    ids, hf, model = logits_equal_hf(path, Qwen2ForCausalLM)
    attn = model.model.layers[0].self_attn
    assert model.config.qkv_bias and attn.o_proj.bias is None
    draft = write_random_draft(tmp_path / "d", path)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(str(path), device="cpu", dtype="float32").generate([ids[:7], ids[:20]], params)
    spec = LLM(str(path), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8").generate(
        [ids[:7], ids[:20]], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:7]]), max_new_tokens=16, do_sample=False)[0, 7:].tolist()
    assert plain[0].token_ids == want
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "use_sliding_window": True, "sliding_window": 32}))
    assert load_target(str(path), "cpu", "float32")[0].config.max_position_embeddings == 32  # the window's


def write_tiny_qwen3(path, vocab=97, hidden=64, heads=4, kv_heads=2, head_dim=24, layers=3, tie=True, seed=0):
    """A random Qwen3 checkpoint (q and k heads normalised before RoPE; a head size that is not hidden / heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                      use_sliding_window=False)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():  # larger weights than HF's init, and norm weights that are not 1
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 / p.shape[-1] ** 0.5 * 4)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def test_qwen3_equals_hf(tmp_path):
    """A Qwen3 checkpoint (per-head q and k norms, head_dim 24 with hidden 64) equals transformers'
    Qwen3ForCausalLM, dense and paged, and its greedy generation; speculative decoding (a draft of its shape, which
    has the norms too, written and read back) equals plain decoding on it."""
    from transformers import Qwen3ForCausalLM
    from eyas import LLM, SamplingParams
    from helpers import write_random_draft
    path = write_tiny_qwen3(tmp_path / "q")
    ids, hf, model = logits_equal_hf(path, Qwen3ForCausalLM)
    attn = model.model.layers[0].self_attn
    assert model.config.qk_norm and not model.config.qkv_bias and attn.q_norm.weight.shape == (24,)
    draft = write_random_draft(tmp_path / "d", path)
    assert json.loads((draft / "config.json").read_text())["qk_norm"] is True
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(str(path), device="cpu", dtype="float32").generate([ids[:7], ids[:20]], params)
    fast = LLM(str(path), device="cpu", dtype="float32", draft=str(draft), speculation="tree:8")
    assert hasattr(fast.engine.draft.layers[0].self_attn, "q_norm")
    spec = fast.generate([ids[:7], ids[:20]], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:7]]), max_new_tokens=16, do_sample=False)[0, 7:].tolist()
    assert plain[0].token_ids == want


@pytest.mark.parametrize("window", [None, 24])
def test_mistral_equals_hf(tmp_path, window):
    """A Mistral checkpoint is a Llama one; with a sliding window, the context is capped at it, within which the
    logits are transformers' (whose sliding-window attention is full attention there)."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=window)
    hf = MistralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 2.0 / p.shape[1] ** 0.5)
    hf.save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model, _ = load_target(str(tmp_path / "m"), "cpu", "float32")
    assert model.config.max_position_embeddings == (window or 256)
    torch.testing.assert_close(paged_logits(model, ids), ref, atol=1e-4, rtol=0)


def test_classic_rope_spelling(tmp_path):
    """Checkpoints in the wild write rope_theta + rope_scaling; transformers 5 writes rope_parameters."""
    path = write_tiny_llama(tmp_path / "m", vocab=50, hidden=32, heads=4, kv_heads=2, rope_scaling=LLAMA3_SCALING)
    raw = json.loads((path / "config.json").read_text())
    ids = list(range(1, 30))
    ref = hf_logits(path, ids)
    params = raw.pop("rope_parameters", None)
    if params is not None:  # rewrite the config the old way and check that eyas reads it the same
        raw["rope_theta"] = params["rope_theta"]
        raw["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        (path / "config.json").write_text(json.dumps(raw))
    model, _ = load_target(str(path), "cpu", "float32")
    assert model.config.rope_scaling["rope_type"] == "llama3"
    out = model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_sharded_checkpoint(tmp_path):
    """Several safetensors files with an index load like one."""
    from transformers import LlamaForCausalLM
    path = write_tiny_llama(tmp_path / "m", vocab=50, hidden=64, heads=4, kv_heads=2)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, _ = load_target(str(path), "cpu", "float32")
    b, _ = load_target(str(tmp_path / "sharded"), "cpu", "float32")
    for (n1, p1), (n2, p2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_target(str(tmp_path / "missing"), "cpu", "float32")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        load_target(str(bad), "cpu", "float32")
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_target(str(d), "cpu", "float32")
    path = write_tiny_llama(tmp_path / "m", vocab=50)
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_target(str(path), "cpu", "float32")
