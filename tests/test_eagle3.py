"""EAGLE-3 draft checkpoints (eyas/models/eagle3.py, eyas/loader/eagle3.py), written by the tests in SafeAILab's
layout (tests/helpers.py `eagle3_weights`) and in vllm-project/speculators'.

The oracle of the draft's forward is HF transformers' Llama modules (RMSNorm, attention with its RoPE, MLP) wired as
the checkpoints' code wires them, fed the target's hidden states as HF returns them: the inputs of layers 2, L//2
and L-3. Speculative decoding with such a draft gives plain decoding's tokens."""
import json

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.loader.eagle import load_draft
from eyas.loader.resolve import load_target
from eyas.spec.draft_vocab import draft_topk
from helpers import (SHORT_CONTEXT, eagle3_weights, interpreted_only, write_checkpoint, write_eagle3_draft,
                     write_tiny_llama)

V, L = 48, 8  # vocabulary, target layers: features from the inputs of layers 2, 4 and 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3")
    target = write_tiny_llama(d / "target", vocab=V, hidden=32, heads=4, kv_heads=2, layers=L, seed=4)
    return target, write_eagle3_draft(d / "draft", target, draft_vocab=20, theta=5000.0)


def hf_eagle3(target_dir, state, config, ids):
    """The reference: (draft output h_{t+1} before the norm [T-1, H], draft logits [T-1, Vd]) for token ids [T],
    feature t paired with the embedding of token t+1 at position t, causal attention over the sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
    hf = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}, attn_implementation="eager")
    H, eps = cfg.hidden_size, cfg.rms_norm_eps

    def norm(name):
        m = LlamaRMSNorm(H, eps)
        m.weight.data = state[name].clone()
        return m

    attn = LlamaAttention(cfg, 0)
    for p in ("q", "k", "v", "o"):  # q/k/v read 2H
        w = state[f"midlayer.self_attn.{p}_proj.weight"]
        setattr(attn, f"{p}_proj", torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
        getattr(attn, f"{p}_proj").weight.data = w.clone()
    mlp = LlamaMLP(cfg)
    for p in ("gate", "up", "down"):
        getattr(mlp, f"{p}_proj").weight.data = state[f"midlayer.mlp.{p}_proj.weight"].clone()
    with torch.no_grad():
        hs = hf(ids[None], output_hidden_states=True).hidden_states  # hs[i]: the input of layer i
        n = hf.config.num_hidden_layers
        feats = torch.cat([hs[2], hs[n // 2], hs[n - 3]], dim=-1)[0, :-1]  # [T-1, 3H]
        h = feats @ state["fc.weight"].t()
        e = hf.model.embed_tokens(ids[1:])
        T = h.shape[0]
        x = torch.cat([norm("midlayer.input_layernorm.weight")(e), norm("midlayer.hidden_norm.weight")(h)], -1)[None]
        pos = torch.arange(T)[None]
        cos_sin = LlamaRotaryEmbedding(cfg)(x, pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        prenorm = h[None] + attn(x, cos_sin, mask)[0]
        out = prenorm + mlp(norm("midlayer.post_attention_layernorm.weight")(prenorm))
        logits = norm("norm.weight")(out) @ state["lm_head.weight"].t()
    return out[0], logits[0]


def test_forward_equals_hf_modules(pair):
    target_dir, draft_dir = pair
    config, state = eagle3_weights(target_dir, draft_vocab=20, theta=5000.0)
    ids = torch.tensor([3, 17, 5, 40, 22, 9, 31, 2, 11])
    want_h, want_logits = hf_eagle3(target_dir, state, config, ids)

    target, _ = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    draft = load_draft(draft_dir, target)
    assert tuple(draft.feature_layers) == (1, 3, 4)  # after layers 1, 3, 4: the inputs of 2, L//2, L-3
    assert draft.rope.cos.shape[0] >= target.config.max_position_embeddings
    T = len(ids) - 1
    with torch.no_grad():
        _, feats = target(ids[None], torch.arange(len(ids))[None], feature_layers=draft.feature_layers)
        assert feats.shape[-1] == 3 * 32  # the taps alone, no final hidden state
        got = draft(target.model.embed_tokens(ids[None, 1:]), draft.read_features(feats[:, :-1]),
                    torch.arange(T)[None])[0]
        torch.testing.assert_close(got, want_h, rtol=1e-4, atol=1e-5)
        # the proposals: the draft's own head after its own norm, draft ids mapped by d2t to target ids
        top = draft_topk(draft, target, got[None], 3)[0]
        want_top = want_logits.topk(3, dim=-1).indices
        assert torch.equal(top, want_top + state["d2t"][want_top])
        assert bool((top % 2 == 0).all())  # the draft vocabulary: every other target token
        # the next depth reads the draft's own output (no fc): the same layer, as the checkpoints' code runs it
        again = draft(target.model.embed_tokens(ids[None, 1:]), got[None], torch.arange(T)[None])
        assert again.shape == (1, T, 32) and not torch.allclose(again[0], got)


def _speculators_layout(tmp_path, target_dir, prefix=""):
    """The same draft as `pair`'s in vllm-project/speculators' layout: layers.0.*, the Llama config nested, the
    target's embedding copied in, and vLLM's convention for the feature layers stated."""
    config, state = eagle3_weights(target_dir, draft_vocab=20, theta=5000.0)
    state = {prefix + k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    hf_state = load_target(str(target_dir), device="cpu", dtype=torch.float32)[0].model.embed_tokens.weight
    state[prefix + "embed_tokens.weight"] = hf_state.detach().clone()
    return write_checkpoint(tmp_path / "spec", {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": config,
        "draft_vocab_size": 20, "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "speculators_config": {"algorithm": "eagle3"}}, state)


@pytest.mark.parametrize("prefix", ["", "model."])
def test_other_layouts_load_the_same_draft(pair, tmp_path, prefix):
    target_dir, draft_dir = pair
    target, _ = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    ref = load_draft(draft_dir, target)
    other = load_draft(_speculators_layout(tmp_path, target_dir, prefix), target)
    assert tuple(other.feature_layers) == tuple(ref.feature_layers)
    ref_state, other_state = ref.state_dict(), other.state_dict()
    assert ref_state.keys() == other_state.keys()
    assert all(torch.equal(ref_state[k], other_state[k]) for k in ref_state)
    # SGLang's (ModelOpt's) convention in eagle_config: the output of layer i
    cfg = json.loads((draft_dir / "config.json").read_text())
    sg = tmp_path / "sglang"
    sg.mkdir()
    sglang_ids = {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}
    (sg / "config.json").write_text(json.dumps({**cfg, "eagle_config": sglang_ids}))
    (sg / "model.safetensors").symlink_to(draft_dir / "model.safetensors")
    assert tuple(load_draft(sg, target).feature_layers) == (0, 2, 6)


@pytest.mark.parametrize("spec", ["chain:3", "tree:8", "dyn:k3d3n6"])
def test_speculative_decoding_with_an_eagle3_draft_equals_plain(pair, spec):
    target_dir, draft_dir = pair
    prompts = [[1, 5, 9, 13], [7, 7, 30, 2, 41, 18], [44]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target_dir), device="cpu", dtype="float32").generate(prompts, params)]
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation=spec,
              max_num_seqs=2)  # preemption-free, but batches that change as requests finish
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert llm.engine.blocks.num_used == 0


@pytest.mark.parametrize("quant", ["int4", "fp8-head"])
def test_quantized_eagle3_drafts(pair, quant):
    """`--draft-quant` int4 (FFN and head) and fp8-head: the quantized head reads the draft's own norm first (its
    logits near the bf16 head's: without the norm they would be far off), and decoding stays plain decoding's."""
    from eyas.spec.draft_quant import quantize_draft
    from eyas.spec.draft_vocab import draft_logits
    target_dir, draft_dir = pair
    target, _ = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    draft = load_draft(draft_dir, target)
    h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        ref = draft_logits(draft, target, h).float()
        quantize_draft(draft, target, quant)
        got = draft_logits(draft, target, h).float()
    assert got.shape == ref.shape == (2, 5, 20)
    assert (got - ref).norm() / ref.norm() < 0.1
    prompts, params = [[1, 5, 9, 13], [44, 3]], SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target_dir), device="cpu", dtype="float32").generate(prompts, params)]
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation="tree:8",
              draft_quant=quant)
    assert llm.draft.quant == quant
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_rank_paths_of_an_eagle3_draft_predict_the_engines_steps(pair):
    """`eyas make-tree`'s rank paths (the draft's chains unrolled over a whole text, `unrolled_streams`, with the
    first layer read as EAGLE-3's) replayed with tree:16 give the engine's target calls and committed tokens exactly.
    The two run the draft's steps along the accepted paths apart: the engine's paged catch-up, features committed
    through fc and tree levels fed the draft's own outputs, against masked streams over the whole text. They share
    the layer's input (`Eagle3Layer.attention_input`), which test_forward_equals_hf_modules holds to HF."""
    import numpy as np

    from eyas.spec.tree import resolve_tree
    from eyas.spec.tree_builder import rank_paths, replay
    from eyas.train.data import Example
    target_dir, draft_dir = pair
    target, _ = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    draft = load_draft(draft_dir, target)
    prompt = [3, 7, 1, 12, 5]
    out = LLM(str(target_dir), device="cpu", dtype="float32").generate(
        prompt, SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
    ex = Example(np.asarray(prompt + out, dtype=np.int32), np.asarray([False] * len(prompt) + [True] * len(out)))
    paths = rank_paths(target, draft, [ex], 4, 16)
    assert len(paths) == len(out) and (paths[:, 0] == 0).sum() >= 3  # the draft is right at times
    tree = [list(p) for p in resolve_tree("tree:16").paths]
    res = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation="tree:16").generate(
        prompt, SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert res.token_ids == out
    assert res.stats.committed > res.stats.target_calls  # something was accepted
    assert (res.stats.target_calls, res.stats.committed) == replay(paths, tree, 32)


@interpreted_only
def test_the_fast_path_with_an_eagle3_draft_equals_plain(pair):
    """The runner's GPU path, interpreted on the CPU: fused target (raw taps from the fused layers), Triton attention,
    the step's fused prologue and draft pairs, the draft's projections fused (its forward stays the modules')."""
    from eyas.models.fused import enable_fast_path
    target_dir, draft_dir = pair
    prompts, params = [[1, 5, 9, 13]], SamplingParams(max_tokens=3, ignore_eos=True)  # (the interpreter is slow)
    want = [o.token_ids for o in LLM(str(target_dir), device="cpu", dtype="float32").generate(prompts, params)]
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation="chain:2",
              max_model_len=SHORT_CONTEXT)
    for model in (llm.target, llm.draft):
        enable_fast_path(model)
    llm.engine.runner.use_triton = True
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_what_is_not_served_is_refused(pair, tmp_path):
    target_dir, _ = pair
    target, _ = load_target(str(target_dir), device="cpu", dtype=torch.float32)

    def write(name, config_change=None, state_change=None):
        config, state = eagle3_weights(target_dir, draft_vocab=20)
        config.update(config_change or {})
        (state_change or (lambda s: None))(state)
        return write_checkpoint(tmp_path / name, config, state)

    cases = [
        ("wide", {"target_hidden_size": 64}, None, "another width"),
        ("vocab", {"draft_vocab_size": 21}, None, "draft_vocab_size"),
        ("d2t", None, lambda s: s["d2t"].__setitem__(0, 10 ** 6), "outside the target's vocabulary"),
        ("nod2t", None, lambda s: s.pop("d2t"), "needs its d2t"),
        ("emb", None, lambda s: s.__setitem__("embed_tokens.weight", torch.zeros(V, 32)), "embed_tokens differ"),
        ("extra", None, lambda s: s.__setitem__("midlayer.self_attn.q_proj.bias", torch.zeros(32)), "no place"),
        ("aux", {"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, None, "do not fit"),
        ("noaux", {"eagle_config": {"use_aux_hidden_state": False}}, None, "use_aux_hidden_state"),
    ]
    for name, cc, sc, msg in cases:
        with pytest.raises(ValueError, match=msg):
            load_draft(write(name, cc, sc), target)
    draft = load_draft(write("ok"), target)
    from eyas.spec.draft_quant import quantize_draft
    from eyas.spec.draft_vocab import attach_draft_vocab
    with pytest.raises(ValueError, match="EAGLE-3"):
        quantize_draft(draft, target, "fp8")
    with pytest.raises(ValueError, match="EAGLE-3"):
        attach_draft_vocab(draft, target, torch.arange(10))
    from eyas.train.trainer import init_from_checkpoint, make_draft
    with pytest.raises(ValueError, match="EAGLE-3"):
        init_from_checkpoint(make_draft(target, 1), tmp_path / "ok")
