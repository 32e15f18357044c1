"""Feature layers (EAGLE-3-style multi-layer target features for the draft): the target's features against HF
transformers, the fused path against the eager one, checkpoints, the identity init (a feature-layer draft made from
an EAGLE-1 draft runs exactly as it does through the engine), exactness of greedy speculative decoding with a
feature-layer draft, sampling, and a short training run whose checkpoint the engine runs exactly."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from eyas import LLM, SamplingParams
from eyas.config import ModelConfig
from eyas.loader.eagle import load_draft
from eyas.loader.resolve import load_target
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM
from helpers import (SHORT_CONTEXT, assert_draft_state, feature_draft_from, interpreted_only, write_distill_setup,
                     write_mirror_pair, write_random_draft, write_tiny_llama)


def rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """The mirror pair (long accepted paths) and feature-layer drafts made from its EAGLE-1 draft."""
    root = tmp_path_factory.mktemp("feat_mirror")
    tdir, ddir = write_mirror_pair(root, vocab=24, layers=2)
    target, _ = load_target(str(tdir), "cpu", "float32")
    ident = feature_draft_from(ddir, target, root / "ident", feature_layers=(0,))
    noisy = feature_draft_from(ddir, target, root / "noisy", feature_layers=(1, 0), noise=0.5)
    return tdir, ddir, ident, noisy


def prompts5(vocab=24):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 9, 23)]


def llm(tdir, draft=None, spec=None, **kw):
    kw.setdefault("num_blocks", 64)  # a small KV pool: the default 1 GiB takes a while to allocate
    return LLM(str(tdir), device="cpu", dtype="float32", draft=str(draft) if draft else None, speculation=spec, **kw)


_PLAIN: dict = {}


def plain(tdir, prompts, params):
    key = (str(tdir), str(prompts), params.max_tokens)
    if key not in _PLAIN:
        _PLAIN[key] = [o.token_ids for o in llm(tdir).generate(prompts, params)]
    return _PLAIN[key]


# ---- the target's features ------------------------------------------------------------------------------------------

def test_target_features_equal_hf_hidden_states(tmp_path):
    from transformers import LlamaForCausalLM as HFLlama
    path = write_tiny_llama(tmp_path / "t", vocab=40, hidden=32, layers=3)
    model, _ = load_target(str(path), "cpu", "float32")
    hf = HFLlama.from_pretrained(path).float().eval()
    last = {}
    hf.model.layers[2].register_forward_hook(
        lambda m, a, out: last.__setitem__("r", out[0] if isinstance(out, tuple) else out))
    ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(11)[None].expand(2, 11)
    with torch.no_grad():
        plain = model(ids, pos)
        hidden, feats = model(ids, pos, feature_layers=(1, 0, 2))  # any order; the last layer pre-norm too
        hs = hf(ids, output_hidden_states=True).hidden_states  # hs[i + 1]: after layer i; hs[-1]: final norm
    eps = model.config.rms_norm_eps
    assert torch.equal(hidden, plain) and feats.shape == (2, 11, 4 * 32)
    ref = torch.cat([rms(hs[2], eps), rms(hs[1], eps), rms(last["r"], eps), hs[-1]], -1)
    torch.testing.assert_close(feats, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        model(ids, pos, feature_layers=(3,))


@interpreted_only
def test_fused_path_features_equal_eager():
    """The fused Triton path (interpreted on the CPU) gives the eager path's features."""
    from eyas.models.fused import enable_fast_path
    cfg = ModelConfig(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
                      max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (2 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.3) +
                    (1.0 if p.dim() == 1 else 0.0))
    model.eval()
    ids = torch.randint(0, 50, (2, 7), generator=g)
    pos = torch.arange(7).repeat(2, 1) + 3
    with torch.no_grad():
        ref_h, ref_f = model(ids, pos, feature_layers=(0, 2))
        enable_fast_path(model)
        h, f = model(ids, pos, feature_layers=(0, 2))
        assert torch.equal(model(ids, pos), h)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f, ref_f, atol=1e-5, rtol=1e-5)


# ---- checkpoints --------------------------------------------------------------------------------------------------

def test_save_load_round_trip_and_layer_check(tmp_path):
    tdir = write_tiny_llama(tmp_path / "t", vocab=17, hidden=32, layers=2)
    target, _ = load_target(str(tdir), "cpu", "float32")
    e1 = write_random_draft(tmp_path / "e1", tdir)
    assert "eyas_feature_layers" not in json.loads((e1 / "config.json").read_text())  # EAGLE-1 config unchanged
    assert load_draft(e1, target).feature_layers is None
    d = feature_draft_from(e1, target, tmp_path / "f", feature_layers=(1, 0), noise=1.0)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["eyas_feature_layers"] == [1, 0]
    w = load_file(str(d / "model.safetensors"))
    assert w["fuse.weight"].shape == (32, 3 * 32)
    back = load_draft(d, target)
    assert back.feature_layers == (1, 0) and back.config.feature_layers == (1, 0)
    assert torch.equal(back.fuse.weight, w["fuse.weight"]) and torch.equal(back.fc.weight, w["fc.weight"])
    feats = torch.randn(2, 5, 96)
    torch.testing.assert_close(back.read_features(feats), feats @ w["fuse.weight"].T)
    # identity init: read_features returns the final hidden state exactly
    back.init_fuse_identity()
    assert torch.equal(back.read_features(feats), feats[..., -32:])
    # a feature layer the target lacks
    bad = json.loads((d / "config.json").read_text())
    bad["eyas_feature_layers"] = [0, 2]
    (d / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"feature layers \[2\] are outside the target's layers 0..1"):
        load_draft(d, target)
    with pytest.raises(ValueError, match="distinct"):
        EagleDraft(dataclasses.replace(back.config, feature_layers=(0, 0)))


# ---- the engine ---------------------------------------------------------------------------------------------------

def test_identity_init_runs_exactly_as_the_eagle1_draft(mirror):
    tdir, e1, ident, _ = mirror
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = []
    for d in (e1, ident):
        m = llm(tdir, d, "chain:3")
        runs.append(m.generate(prompts5(), params))
    assert m.draft.feature_layers == (0,)
    a, b = runs
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [(o.stats.target_calls, o.stats.committed, o.stats.accepted_by_depth) for o in a] == \
        [(o.stats.target_calls, o.stats.committed, o.stats.accepted_by_depth) for o in b]
    tpc = sum(o.stats.committed for o in b) / sum(o.stats.target_calls for o in b)
    assert tpc > 1.5, tpc  # long paths were accepted: the comparison covers the deep code paths


@pytest.mark.parametrize("spec", ["chain:3", "tree:8"])
def test_greedy_with_a_feature_layer_draft_equals_plain(mirror, spec):
    tdir, _, _, noisy = mirror
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = plain(tdir, prompts5(), params)
    outs = llm(tdir, noisy, spec).generate(prompts5(), params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.stats.committed for o in outs) > sum(o.stats.target_calls for o in outs)  # drafts were accepted
    if spec == "tree:8":  # chunked prefills and preemption (re-prefill) too
        small = llm(tdir, noisy, spec, num_blocks=14, block_size=4, max_num_batched_tokens=8)
        assert [o.token_ids for o in small.generate(prompts5(), params)] == ref
        assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("spec", ["chain:3", "tree:8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_feature_buffer_and_draft_kv_hold_the_committed_history(mirror, spec, temperature):
    """A feature-layer draft (the shipped draft's kind), after steps with rejected branches: the sequence's slot of
    the draft's hidden-state buffer holds fuse(features) of the committed positions the draft has still to read,
    and the draft KV the pairs (x_{t+1}, fuse(f_t)) it has read, both against dense forwards of the committed
    tokens (as tests/test_spec.py's test for an EAGLE-1 draft)."""
    tdir, _, _, noisy = mirror
    m = llm(tdir, noisy, spec, block_size=4)
    engine = m.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=200, seed=7, ignore_eos=True))
            for p in prompts5()]
    for _ in range(8):
        engine.step()
    target, draft = m.target, m.draft
    if spec.startswith("chain"):  # a chain's path was cut somewhere (a tree rejects its other branches every step)
        assert sum(s.stats.committed for s in seqs) < 4 * sum(s.stats.target_calls for s in seqs)
    for seq in seqs:
        n, d = seq.num_cached, seq.num_draft_cached
        assert n == len(seq.token_ids) - 1 and 0 < d <= n and seq.stats.target_calls > 0
        ids, pos = torch.tensor([seq.token_ids[:n]]), torch.arange(n)[None]
        _, feats = target(ids, pos, feature_layers=draft.feature_layers)
        assert_draft_state(engine, seq, target, draft, draft.read_features(feats), 4)
    for seq in seqs:
        engine.abort(seq.request_id)
    assert engine.blocks.num_used == 0


@interpreted_only
def test_fast_path_with_a_feature_layer_draft_equals_reference(mirror):
    """Fused target (features from the fused layers) and Triton attention, interpreted on the CPU."""
    from eyas.models.fused import enable_fast_path
    tdir, _, _, noisy = mirror
    prompts, params = prompts5()[:2], SamplingParams(max_tokens=6, ignore_eos=True)
    ref = plain(tdir, prompts, params)
    m = llm(tdir, noisy, "tree:8", max_model_len=SHORT_CONTEXT)
    for model in (m.target, m.draft):
        enable_fast_path(model)
    m.engine.runner.use_triton = True
    assert [o.token_ids for o in m.generate(prompts, params)] == ref


def test_sampling_with_a_feature_layer_draft(mirror):
    tdir, _, _, noisy = mirror
    m = llm(tdir, noisy, "tree:8")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7)
    a = m.generate(prompts5(), params)
    b = m.generate(prompts5()[1:2], params)
    assert b[0].token_ids == a[1].token_ids  # (seed, position) sampling: reproducible, whatever the batch
    assert all(len(o.token_ids) == 12 and all(0 <= t < 24 for t in o.token_ids) for o in a)
    assert sum(o.stats.committed for o in a) > sum(o.stats.target_calls for o in a)


# ---- training -----------------------------------------------------------------------------------------------------

VOCAB, PROMPT, SEQ = 64, 8, 40


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """As tests/test_train.py's (`helpers.write_distill_setup`), shorter."""
    return write_distill_setup(tmp_path_factory.mktemp("feat_train"), VOCAB, PROMPT, SEQ, 120)


def _cfg(tdir, data, out, **kw):
    from eyas.train.trainer import TrainConfig
    base = dict(target=str(tdir), data=[str(data)], out=str(out), device="cpu", batch_tokens=1024, heldout=24,
                lr=3e-3, noise_std=0.05, tpc_prompts=0, progress=False, seed=0, eval_depth=2)
    base.update(kw)
    return TrainConfig(**base)


def test_training_with_feature_layers(tiny_setup, tmp_path):
    from eyas.train.data import load_examples
    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    fl = dict(feature_layers=[0, 1], unroll=2)
    before = train(_cfg(tdir, data, tmp_path / "b", lr=0.0, max_steps=1, **fl), target)["final_metrics"]["layers-1"]
    summary = train(_cfg(tdir, data, tmp_path / "a", epochs=8, lr=5e-3, **fl), target)
    after = summary["final_metrics"]["layers-1"]
    assert summary["finished"] and after["loss"] < 0.8 * before["loss"], (before, after)
    out = tmp_path / "a"
    info = json.loads((out / "training.json").read_text())
    assert info["feature_layers"] == [0, 1] and info["unroll"]["steps"] == 2
    w = load_file(str(out / "model.safetensors"))
    H = 64
    assert w["fuse.weight"].shape == (H, 3 * H)
    assert w["fuse.weight"][:, :-H].float().abs().max() > 0  # the fuse was trained off its identity init
    # the engine loads it and runs it exactly
    prompt = load_examples([data])[0].prompt_ids()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    res = llm(tdir, out, "chain:3").generate(prompt, params)[0]
    assert res.token_ids == plain(tdir, [prompt], params)[0] and res.stats.target_calls > 0


def test_init_from_an_eagle1_checkpoint_starts_from_that_draft(tiny_setup, tmp_path):
    """--init of an EAGLE-1 checkpoint with --feature-layers: fuse at the identity, so (lr 0) the held-out metrics
    are exactly the EAGLE-1 draft's. A feature-layer checkpoint with other layers is refused."""
    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    kw = dict(lr=0.0, max_steps=1, noise="none", save_dtype="float32")
    e1 = train(_cfg(tdir, data, tmp_path / "e1", **kw), target)["final_metrics"]["layers-1"]
    f = train(_cfg(tdir, data, tmp_path / "f", init=str(tmp_path / "e1"), feature_layers=[1], **kw),
              target)["final_metrics"]["layers-1"]
    assert f["loss"] == e1["loss"] and f["acc_by_depth"] == e1["acc_by_depth"]
    with pytest.raises(ValueError, match="feature layers"):
        train(_cfg(tdir, data, tmp_path / "g", init=str(tmp_path / "f"), feature_layers=[0], **kw), target)


def test_init_may_add_feature_layers_and_starts_from_that_draft(tiny_setup, tmp_path):
    """--init of a trained feature-layer checkpoint with more --feature-layers (here one before its own): `fuse`'s
    columns for its layer and the final hidden state are the checkpoint's, the added layer's zero, so (lr 0) the
    held-out metrics are the checkpoint draft's. Dropping one of its layers is refused."""
    from safetensors.torch import load_file as load

    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    f = train(_cfg(tdir, data, tmp_path / "f", feature_layers=[1], max_steps=3, lr=5e-3, noise="none",
                   save_dtype="float32"), target)["final_metrics"]["layers-1"]
    H = 64
    assert load(str(tmp_path / "f" / "model.safetensors"))["fuse.weight"][:, :H].abs().max() > 0  # trained
    kw = dict(lr=0.0, max_steps=1, noise="none", save_dtype="float32")
    g = train(_cfg(tdir, data, tmp_path / "g", init=str(tmp_path / "f"), feature_layers=[0, 1], **kw),
              target)["final_metrics"]["layers-1"]
    assert g["loss"] == pytest.approx(f["loss"], rel=1e-5) and g["acc_by_depth"] == f["acc_by_depth"]
    w = load(str(tmp_path / "g" / "model.safetensors"))["fuse.weight"]
    assert w.shape == (H, 3 * H) and w[:, :H].abs().max() == 0  # layer 0's columns: zero at lr 0
    with pytest.raises(ValueError, match="may add layers, not drop them"):
        train(_cfg(tdir, data, tmp_path / "h", init=str(tmp_path / "g"), feature_layers=[0], **kw), target)


def test_drafts_side_by_side_share_the_feature_layers(tiny_setup, tmp_path):
    from eyas.train.trainer import make_draft, shared_feature_layers, train

    tdir, data, target = tiny_setup
    summ = train(_cfg(tdir, data, tmp_path / "s", layers=[1, 2], feature_layers=[1], max_steps=2), target)
    assert summ["feature_layers"] == [1] and summ["steps"] == 2
    for L in (1, 2):
        assert json.loads((tmp_path / "s" / f"layers-{L}" / "config.json").read_text())["eyas_feature_layers"] == [1]
    with pytest.raises(ValueError, match="same feature layers"):
        shared_feature_layers([make_draft(target, 1, [0]), make_draft(target, 1, [1])])
    with pytest.raises(ValueError, match="outside"):
        make_draft(target, 1, [2])
