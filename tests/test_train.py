"""Draft training: the loss against hand-computed values, data formatting and batching, the unrolled evaluation,
a short CPU training run of a tiny draft against a tiny target, exact resume, and make-distill-data."""
from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eyas.train.data import (collate, conversation_segments, load_examples, make_example, plan_epoch,
                             split_heldout)
from eyas.train.loss import distill_loss

from helpers import interpreted_only, write_distill_setup, write_tiny_chat_model


# ---- 1. the loss, by hand ----------------------------------------------------------------------------------------

def test_loss_matches_hand_computed_values():
    ln = math.log
    dh = torch.tensor([[0.5, -1.0], [2.0, 0.0], [0.0, 3.0]])
    th = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.2, 0.0]])
    dl = torch.tensor([[0.0, 0.0, ln(2)], [0.0, 0.0, 5.0], [ln(3), ln(2), 0.0]])
    tl = torch.tensor([[0.0, ln(2), 0.0], [5.0, 0.0, 0.0], [ln(3), 0.0, 0.0]])
    mask = torch.tensor([True, False, True])  # the middle position (large errors) must not count

    # SmoothL1 (beta 1): 0.5 d^2 below 1, |d| - 0.5 above; averaged over H, then over masked positions
    l1_0 = (0.5 * 0.5 ** 2 + (1.0 - 0.5)) / 2  # d = (0.5, -1.0)
    l1_2 = (0.5 * 0.2 ** 2 + (3.0 - 0.5)) / 2  # d = (-0.2, 3.0)
    l1 = (l1_0 + l1_2) / 2
    # soft CE: target p = softmax(tl), draft q = softmax(dl)
    ce_0 = -(0.25 * ln(0.25) + 0.5 * ln(0.25) + 0.25 * ln(0.5))  # p = (1/4, 1/2, 1/4), q = (1/4, 1/4, 1/2)
    ce_2 = -(0.6 * ln(0.5) + 0.2 * ln(1 / 3) + 0.2 * ln(1 / 6))  # p = (3/5, 1/5, 1/5), q = (1/2, 1/3, 1/6)
    ce = (ce_0 + ce_2) / 2

    out = distill_loss(dh, th, dl, tl, mask)  # defaults w_ce = 0.1, w_l1 = 1.0
    assert out.l1.item() == pytest.approx(l1, rel=1e-6)
    assert out.ce.item() == pytest.approx(ce, rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * ce + 1.0 * l1, rel=1e-6)
    assert out.count.item() == 2 and out.correct.item() == 1  # position 2 agrees (argmax 0), position 0 does not

    out = distill_loss(dh, th, dl, tl, mask.float(), w_ce=0.5, w_l1=2.0)
    assert out.loss.item() == pytest.approx(0.5 * ce + 2.0 * l1, rel=1e-6)

    # sharpened soft labels (ce_temperature 0.5): p = softmax(tl / 0.5), the L1 term unchanged
    ce_0 = -(1 / 6 * ln(0.25) + 2 / 3 * ln(0.25) + 1 / 6 * ln(0.5))  # p = (1, 4, 1) / 6
    ce_2 = -(9 / 11 * ln(0.5) + 1 / 11 * ln(1 / 3) + 1 / 11 * ln(1 / 6))  # p = (9, 1, 1) / 11
    out = distill_loss(dh, th, dl, tl, mask, ce_temperature=0.5)
    assert out.ce.item() == pytest.approx((ce_0 + ce_2) / 2, rel=1e-6)
    assert out.l1.item() == pytest.approx(l1, rel=1e-6)
    # ... and towards 0 the target's argmax as a hard label: -log q[argmax]
    out = distill_loss(dh, th, dl, tl, mask, ce_temperature=1e-3)
    assert out.ce.item() == pytest.approx((-ln(0.25) - ln(0.5)) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="ce_temperature must be > 0"):
        distill_loss(dh, th, dl, tl, mask, ce_temperature=0.0)

    # a hard-label term beside the soft one (w_hard): -log q[argmax of the target], masked mean, the rest unchanged
    hard = (-ln(0.25) - ln(0.5)) / 2  # argmax 1 at position 0 (q 1/4), 0 at position 2 (q 1/2)
    out = distill_loss(dh, th, dl, tl, mask, w_hard=0.7)
    assert out.loss.item() == pytest.approx(0.1 * ce + 0.7 * hard + 1.0 * l1, rel=1e-6)
    assert out.ce.item() == pytest.approx(ce, rel=1e-6) and out.l1.item() == pytest.approx(l1, rel=1e-6)
    with pytest.raises(ValueError, match="w_hard must be >= 0"):
        distill_loss(dh, th, dl, tl, mask, w_hard=-1.0)

    # batched [B, T, ...] layout gives the same numbers; gradients flow to the draft side only
    dh2 = dh[None].clone().requires_grad_(True)
    out = distill_loss(dh2, th[None], dl[None], tl[None], mask[None])
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.1 * ce + 1.0 * l1, rel=1e-6)
    assert torch.all(dh2.grad[0, 1] == 0) and torch.any(dh2.grad[0, 0] != 0)


# ---- data ----------------------------------------------------------------------------------------------------------

def test_plan_epoch_covers_everything_within_budget_and_is_deterministic():
    rng = np.random.RandomState(0)
    lengths = rng.randint(5, 300, size=500).tolist()
    plan = plan_epoch(lengths, batch_tokens=1024, max_batch=16, seed=3, epoch=0)
    flat = sorted(i for b in plan for i in b)
    assert flat == list(range(500))
    for b in plan:
        assert len(b) <= 16 and (len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 1024)
    assert plan == plan_epoch(lengths, 1024, 16, 3, 0)
    assert plan != plan_epoch(lengths, 1024, 16, 3, 1)
    pad = sum(max(lengths[i] for i in b) * len(b) for b in plan) / sum(lengths)
    assert pad < 1.2  # length grouping keeps padding small


def test_examples_collate_and_heldout_split(tmp_path):
    f = tmp_path / "toks.jsonl.gz"
    with gzip.open(f, "wt") as fh:
        for n in range(10):
            fh.write(json.dumps({"input_ids": list(range(3 + n)), "loss_mask": [0, 0] + [1] * (1 + n)}) + "\n")
        fh.write(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [1, 1, 0]}) + "\n")  # nothing to learn at t+2
    exs = load_examples([f], max_len=8)
    assert len(exs) == 10 and max(len(e) for e in exs) == 8
    assert exs[0].prompt_ids() == [0, 1]
    ids, mask = collate(exs, [0, 5])
    assert ids.shape == (2, 8) and mask[0].tolist() == [False, False, True] + [False] * 5
    train, held = split_heldout(exs, 3, seed=0)
    assert len(train) == 7 and len(held) == 3
    assert make_example([1, 2], [1, 1], 10) is None


def test_length_batches_cover_everything_within_budget():
    from eyas.train.data import length_batches
    lengths = [5, 40, 7, 7, 100, 3, 12, 12, 12, 60]
    batches = length_batches(lengths, 48)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths)  # similar lengths together
    for b in batches:  # within budget, or alone
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 48
    for a, b in zip(batches, batches[1:]):  # each cut is forced: the next example would not fit
        assert (len(a) + 1) * lengths[b[0]] > 48
    assert batches[-1] == [4]  # 100 tokens: alone
    assert length_batches([], 8) == []


def _smollm2_tokenizer():
    from conftest import smollm2_tokenizer
    return smollm2_tokenizer()


def test_chat_template_mask_covers_assistant_turns_only():
    tok = _smollm2_tokenizer()
    conv = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "It is 4."},
                               {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]}
    from eyas.train.data import normalize_messages, tokenize_conversation
    msgs = normalize_messages(conv)
    ex = tokenize_conversation(tok, msgs, 4096)
    full = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert ex.ids.tolist() == tok.encode(full)  # segment-wise tokenisation equals whole-text tokenisation
    masked = tok.decode([t for t, m in zip(ex.ids.tolist(), ex.mask) if m], skip_special_tokens=False)
    assert masked == "It is 4.<|im_end|>\n6.<|im_end|>\n"
    prompt = tok.decode(ex.prompt_ids(), skip_special_tokens=False)
    assert prompt == tok.apply_chat_template(msgs[:1], add_generation_prompt=True)
    segs = conversation_segments(tok, msgs)
    assert [a for _, a in segs] == [False, False, True, False, False, True]


# ---- the unrolled evaluation --------------------------------------------------------------------------------------

def test_unrolled_streams_match_step_by_step_chains():
    from eyas.config import ModelConfig
    from eyas.models.eagle import EagleDraft
    from eyas.train.trainer import unrolled_streams

    cfg = ModelConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=64)
    torch.manual_seed(0)
    draft = EagleDraft(cfg).eval()
    B, T, H = 2, 9, 16
    emb, feats = torch.randn(B, T, H), torch.randn(B, T, H)
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        s1, s2, s3 = unrolled_streams(draft, emb, feats, pos, 3)
        torch.testing.assert_close(s1, draft(emb, feats, pos), atol=1e-5, rtol=1e-5)
        for t in (0, 3, 6):  # a chain rooted at t: history with true features, then the draft's own features
            f1 = draft(emb[:, : t + 1], feats[:, : t + 1], pos[:, : t + 1])[:, -1]
            x2 = torch.cat([feats[:, : t + 1], f1[:, None]], 1)
            f2 = draft(emb[:, : t + 2], x2, pos[:, : t + 2])[:, -1]
            x3 = torch.cat([x2, f2[:, None]], 1)
            f3 = draft(emb[:, : t + 3], x3, pos[:, : t + 3])[:, -1]
            torch.testing.assert_close(s2[:, t + 1], f2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s3[:, t + 2], f3, atol=1e-5, rtol=1e-5)


def test_unrolled_loss_equals_the_weighted_losses_of_step_by_step_chains():
    """Training-time unrolling (`--unroll 3`): the loss is sum_d decay^(d-1) * loss_d / sum of weights, where loss_d
    holds the draft's d-th chain step (run here step by step, as the engine does) to the target at the positions
    whose chain root exists; and the gradient flows through the draft's own features."""
    from eyas.config import ModelConfig
    from eyas.models.eagle import EagleDraft
    from eyas.models.llama import LlamaForCausalLM
    from eyas.train.trainer import TrainConfig, unrolled_loss

    cfg = ModelConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=64)
    torch.manual_seed(1)
    target = LlamaForCausalLM(cfg).eval()
    draft = EagleDraft(cfg)
    B, T, H = 2, 7, 16
    emb, feats, tgt_h = torch.randn(B, T, H), torch.randn(B, T, H), torch.randn(B, T, H)
    pos = torch.arange(T)[None].expand(B, T)
    lmask = torch.rand(B, T, generator=torch.Generator().manual_seed(3)) < 0.7
    lmask[0, :3] = True
    tcfg = TrainConfig(unroll=3, unroll_decay=0.5, w_ce=0.3, w_l1=1.0, w_hard=0.2, amp=False)
    tgt_sel = tgt_h[lmask]
    with torch.no_grad():
        tlog = target.compute_logits(tgt_sel)
    loss, first = unrolled_loss(target, draft, emb, feats, pos, tgt_sel, tlog, lmask, tcfg)

    # oracle: chains rooted at every t, step by step with the plain forward
    with torch.no_grad():
        outs = [torch.zeros(B, T, H) for _ in range(3)]
        for t in range(T):
            x = feats[:, : t + 1]
            for d in range(3):
                if t + d >= T:
                    break
                f = draft(emb[:, : t + d + 1], x, pos[:, : t + d + 1])[:, -1]
                outs[d][:, t + d] = f
                x = torch.cat([x, f[:, None]], 1)
        want, wsum = 0.0, 0.0
        col = lmask.nonzero()[:, 1]
        for d in range(3):
            o = outs[d][lmask]
            lo = distill_loss(o, tgt_sel, target.compute_logits(o), tlog, col >= d, 0.3, 1.0, w_hard=0.2)
            want += 0.5 ** d * float(lo.loss)
            wsum += 0.5 ** d
        lo1 = distill_loss(outs[0][lmask], tgt_sel, target.compute_logits(outs[0][lmask]), tlog, None, 0.3, 1.0,
                           w_hard=0.2)
    assert float(loss.detach()) == pytest.approx(want / wsum, rel=1e-5)
    assert float(first.loss.detach()) == pytest.approx(float(lo1.loss), rel=1e-5)
    # unroll=1 is the plain loss
    one, _ = unrolled_loss(target, draft, emb, feats, pos, tgt_sel, tlog, lmask, dataclasses_replace(tcfg, unroll=1))
    assert float(one.detach()) == pytest.approx(float(lo1.loss), rel=1e-5)
    # the deeper steps' gradient reaches fc through the draft's own features: it differs from unroll=1's
    loss.backward()
    g3 = draft.fc.weight.grad.clone()
    draft.zero_grad()
    one.backward()
    assert not torch.allclose(g3, draft.fc.weight.grad)


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


# ---- training on a tiny target --------------------------------------------------------------------------------------

VOCAB, PROMPT, SEQ = 64, 8, 64


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny target and data sampled from it (`helpers.write_distill_setup`): 8 prompt tokens, then the target's own
    continuation (the loss mask)."""
    return write_distill_setup(tmp_path_factory.mktemp("tiny_train"), VOCAB, PROMPT, SEQ, 240)


def _cfg(tdir, data, out, **kw):
    from eyas.train.trainer import TrainConfig
    base = dict(target=str(tdir), data=[str(data)], out=str(out), device="cpu", batch_tokens=1024, heldout=40,
                lr=3e-3, noise_std=0.05, tpc_prompts=8, tpc_max_tokens=24, progress=False, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_short_training_lowers_heldout_loss_and_beats_chance(tiny_setup, tmp_path):
    from eyas import LLM, SamplingParams
    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    before = train(_cfg(tdir, data, tmp_path / "b", lr=0.0, max_steps=1, tpc_prompts=0), target)
    before = before["final_metrics"]["layers-1"]
    summary = train(_cfg(tdir, data, tmp_path / "a", epochs=10, eval_every=65), target)
    after = summary["final_metrics"]["layers-1"]
    # chance: always predicting the target's most frequent top-1 token on the held-out positions
    from eyas.train.data import load_examples, split_heldout
    _, held = split_heldout(load_examples([data]), 40, 0)
    with torch.no_grad():
        top = torch.cat([target.compute_logits(target(torch.tensor(e.ids, dtype=torch.long)[None],
                                                      torch.arange(len(e))[None]))[0, PROMPT:].argmax(-1)
                         for e in held])
    chance = top.bincount().max().item() / len(top)
    assert summary["steps"] == summary["schedule_steps"] and summary["finished"]
    assert after["loss"] < 0.6 * before["loss"]
    assert after["acc_by_depth"][0] > max(0.35, 4 * chance), (after, chance)
    assert after["acc_by_depth"][2] > 3 * chance
    assert after["tpc_chain:3"] > 1.3
    assert [e["step"] for e in summary["evals"]] == [0, 65, 130]  # periodic evaluation ran

    # the output is an EAGLE checkpoint the engine loads; training.json records the run
    out = tmp_path / "a"
    info = json.loads((out / "training.json").read_text())
    assert info["loss_weights"] == {"w_ce": 0.1, "w_l1": 1.0, "ce_temperature": 1.0, "w_hard": 0.0}
    assert info["steps"] == summary["steps"]
    assert info["final_metrics"]["acc_by_depth"] == after["acc_by_depth"]
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    llm = LLM(str(tdir), device="cpu", dtype="float32", draft=str(out), speculation="chain:3")
    prompt = load_examples([data])[0].prompt_ids()
    res = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    plain = LLM(str(tdir), device="cpu", dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert res.token_ids == plain.token_ids and res.stats.tokens_per_call > 1.0


def test_unrolled_training_raises_deep_accuracy(tiny_setup, tmp_path):
    """`--unroll 3` on the tiny pair: it trains, records its setting, and the depth-3 accuracy beats the same run
    without unrolling (the draft learns to read its own features)."""
    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    kw = dict(epochs=4, tpc_prompts=0)
    plain = train(_cfg(tdir, data, tmp_path / "u1", **kw), target)["final_metrics"]["layers-1"]
    summ = train(_cfg(tdir, data, tmp_path / "u3", unroll=3, **kw), target)
    deep = summ["final_metrics"]["layers-1"]
    assert summ["unroll"] == {"steps": 3, "decay": 0.8}
    print(plain["acc_by_depth"], deep["acc_by_depth"])
    assert deep["acc_by_depth"][2] > plain["acc_by_depth"][2], (plain, deep)


def test_init_grows_deeper_drafts_that_start_as_the_checkpoint(tiny_setup, tmp_path):
    """--layers 1 2 3 --init <a 1-layer draft>: the added layers start as the identity, so (lr 0) all three drafts
    give the 1-layer draft's held-out loss, accuracy and engine TPC exactly; one training step moves the added layers
    off zero. A checkpoint deeper than the draft is refused."""
    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    train(_cfg(tdir, data, tmp_path / "d1", epochs=6, tpc_prompts=0, save_dtype="float32"), target)
    kw = dict(init=str(tmp_path / "d1"), max_steps=1, noise="none")
    ref = train(_cfg(tdir, data, tmp_path / "r", lr=0.0, **kw), target)["final_metrics"]["layers-1"]
    grown = train(_cfg(tdir, data, tmp_path / "g", layers=[1, 2, 3], lr=0.0, **kw), target)["final_metrics"]
    assert ref["acc_by_depth"][0] > 0.2  # a trained draft, not a blank one
    for L in (1, 2, 3):
        m = grown[f"layers-{L}"]
        assert (m["loss"], m["acc_by_depth"], m["tpc_chain:3"]) == (ref["loss"], ref["acc_by_depth"],
                                                                      ref["tpc_chain:3"]), L
    train(_cfg(tdir, data, tmp_path / "s", layers=[2], tpc_prompts=0, save_dtype="float32", **kw), target)
    assert json.loads((tmp_path / "s" / "training.json").read_text())["init"] == str(tmp_path / "d1")
    w = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert w["layers.1.self_attn.o_proj.weight"].abs().max() > 0 and w["layers.1.mlp.down_proj.weight"].abs().max() > 0
    with pytest.raises(ValueError, match="more than"):
        train(_cfg(tdir, data, tmp_path / "x", init=str(tmp_path / "s"), max_steps=1), target)


def test_init_widens_drafts_that_start_as_the_checkpoint(tiny_setup, tmp_path):
    """--draft-intermediate 3I --init <a draft I wide>: the added MLP units start silent, so (lr 0) the wide draft
    gives the checkpoint's held-out loss, accuracy and engine TPC exactly; the engine loads the wide checkpoint, and
    its greedy output is plain decoding's; one training step moves the added units' down columns off zero. A
    checkpoint wider than the draft is refused."""
    from eyas import LLM, SamplingParams
    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    I = target.config.intermediate_size
    train(_cfg(tdir, data, tmp_path / "d1", epochs=6, tpc_prompts=0, save_dtype="float32"), target)
    kw = dict(init=str(tmp_path / "d1"), max_steps=1, noise="none")
    ref = train(_cfg(tdir, data, tmp_path / "r", lr=0.0, **kw), target)["final_metrics"]["layers-1"]
    wide = train(_cfg(tdir, data, tmp_path / "w", lr=0.0, draft_intermediate=3 * I, **kw),
                 target)["final_metrics"]["layers-1"]
    assert ref["acc_by_depth"][0] > 0.2  # a trained draft, not a blank one
    assert (wide["loss"], wide["acc_by_depth"], wide["tpc_chain:3"]) == (ref["loss"], ref["acc_by_depth"],
                                                                         ref["tpc_chain:3"])
    train(_cfg(tdir, data, tmp_path / "s", draft_intermediate=3 * I, tpc_prompts=0, save_dtype="float32", **kw),
          target)
    w = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert w["layers.0.mlp.gate_proj.weight"].shape == (3 * I, target.config.hidden_size)
    assert w["layers.0.mlp.down_proj.weight"][:, I:].abs().max() > 0
    assert json.loads((tmp_path / "s" / "config.json").read_text())["intermediate_size"] == 3 * I
    prompt = load_examples([data])[0].prompt_ids()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    res = LLM(str(tdir), device="cpu", dtype="float32", draft=str(tmp_path / "s"), speculation="chain:3").generate(
        prompt, sp)[0]
    plain = LLM(str(tdir), device="cpu", dtype="float32").generate(prompt, sp)[0]
    assert res.token_ids == plain.token_ids and res.stats.tokens_per_call > 1.0
    with pytest.raises(ValueError, match="wider than"):
        train(_cfg(tdir, data, tmp_path / "x", init=str(tmp_path / "s"), max_steps=1), target)


def test_first_answer_tokens_keeps_the_start_of_each_assistant_turn():
    from eyas.train.data import Example, first_answer_tokens

    ids = np.arange(12, dtype=np.int32)
    mask = np.array([0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0], dtype=bool)  # two assistant turns, of 4 and 3 tokens
    two = first_answer_tokens(Example(ids, mask), 2)
    assert two.mask.tolist() == [False, False, True, True, False, False, False, False, True, True]
    assert two.ids.tolist() == list(range(10))  # cut after the last token that stays
    four = first_answer_tokens(Example(ids, mask), 4)
    assert four.mask.tolist() == mask[:11].tolist() and four.ids.tolist() == list(range(11))
    # a turn that opens the sequence (pre-tokenised data masked throughout) counts from index 0
    assert first_answer_tokens(Example(ids[:5], np.ones(5, bool)), 3).mask.tolist() == [True] * 3
    # nothing a draft learns from left (its loss at t is on token t + 2): dropped
    assert first_answer_tokens(Example(ids[:6], np.array([0, 1, 1, 1, 1, 1], bool)), 1) is None
    with pytest.raises(ValueError, match=">= 1"):
        first_answer_tokens(Example(ids, mask), 0)


def test_answer_tokens_trains_on_answer_starts_and_evaluates_whole_answers(tiny_setup, tmp_path):
    """--answer-tokens N: the training batches hold each example up to its N-th answer token, the held-out
    evaluation still covers whole answers (its positions are the default run's), and training.json records N."""
    from eyas.train.data import first_answer_tokens
    from eyas.train.trainer import train

    tdir, data, target = tiny_setup
    kw = dict(epochs=1, tpc_prompts=0)
    whole = train(_cfg(tdir, data, tmp_path / "w", **kw), target)
    start = train(_cfg(tdir, data, tmp_path / "s", answer_tokens=4, **kw), target)
    train_exs, _ = split_heldout(load_examples([data]), 40, 0)
    assert whole["tokens_seen"] == sum(len(e) for e in train_exs)
    assert start["tokens_seen"] == sum(len(first_answer_tokens(e, 4)) for e in train_exs) == (PROMPT + 4) * 200
    assert start["final_metrics"]["layers-1"]["positions"] == whole["final_metrics"]["layers-1"]["positions"]
    assert json.loads((tmp_path / "s" / "training.json").read_text())["answer_tokens"] == 4
    with pytest.raises(ValueError, match="--answer-tokens"):  # refused before anything loads
        train(_cfg("no-such-target", data, tmp_path / "x", answer_tokens=0))


def test_resume_repeats_the_uninterrupted_loss_curve(tiny_setup, tmp_path):
    from eyas.train.trainer import main, train

    tdir, data, target = tiny_setup
    kw = dict(layers=[1, 2], max_steps=8, heldout=40, tpc_prompts=0, noise="uniform", noise_std=0.2)
    full = train(_cfg(tdir, data, tmp_path / "full", **kw), target)["history"]
    assert len(full) == 8
    part = train(_cfg(tdir, data, tmp_path / "part", stop_after=3, **kw), target)
    assert part["steps"] == 3 and not part["finished"]
    # resume through the command line (target and data loaded from disk this time)
    rc = main(["--target", str(tdir), "--data", str(data), "--out", str(tmp_path / "part"), "--layers", "1", "2",
               "--device", "cpu", "--batch-tokens", "1024", "--heldout", "40", "--lr", "3e-3", "--max-steps", "8",
               "--tpc-prompts", "0", "--noise-std", "0.2", "--resume", "auto", "--no-progress"])
    assert rc == 0
    info = json.loads((tmp_path / "part" / "training.json").read_text())
    curve = info["loss_curve"]
    assert [c["step"] for c in curve] == list(range(1, 9))
    for c, h in zip(curve, full):
        for L in ("layers-1", "layers-2"):
            assert c[L] == pytest.approx(h[L]["loss"], rel=1e-6, abs=1e-7)
    for L in (1, 2):
        a = load_file(str(tmp_path / "full" / f"layers-{L}" / "model.safetensors"))
        b = load_file(str(tmp_path / "part" / f"layers-{L}" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- make-distill-data ------------------------------------------------------------------------------------------------

def test_make_distill_data_regenerates_assistant_turns(tmp_path):
    from eyas import LLM, SamplingParams
    from eyas.train.distill_data import main

    tok = _smollm2_tokenizer()
    mdir = write_tiny_chat_model(tmp_path / "m", tok)
    src = tmp_path / "in.jsonl"
    convs = [[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
              {"role": "user", "content": "Tell me more."}, {"role": "assistant", "content": "No."}],
             [{"role": "user", "content": "One question"}, {"role": "assistant", "content": "One answer"}],
             [{"role": "user", "content": "skipped by --limit"}, {"role": "assistant", "content": "x"}]]
    src.write_text("".join(json.dumps({"id": f"c{i}", "conversations": c}) + "\n" for i, c in enumerate(convs)))
    out = tmp_path / "out.jsonl.gz"
    assert main(["--model", str(mdir), "--data", str(src), "--out", str(out), "--max-tokens", "6",
                 "--batch-size", "2", "--limit", "2", "--device", "cpu"]) == 0
    recs = [json.loads(x) for x in gzip.open(out, "rt")]
    assert [r["id"] for r in recs] == ["c0", "c1"]
    c0 = recs[0]["conversations"]
    assert [m["role"] for m in c0] == ["user", "assistant", "user", "assistant"]
    assert c0[0]["content"] == "Hello" and c0[2]["content"] == "Tell me more."
    # each assistant turn is what the model itself says after the regenerated history
    llm = LLM(str(mdir), device="cpu", dtype="float32")
    p = SamplingParams(temperature=0, max_tokens=6)
    assert c0[1]["content"] == llm.chat(c0[:1], p)[0].text
    assert c0[3]["content"] == llm.chat(c0[:3], p)[0].text
    assert load_examples([out], tok)  # and the result is training data


def test_make_distill_data_first_turns_chunks_and_time_budget(tmp_path, capsys):
    from eyas.train.distill_data import main

    tok = _smollm2_tokenizer()
    mdir = write_tiny_chat_model(tmp_path / "m", tok)
    src = tmp_path / "in.jsonl"
    convs = [[{"role": "user", "content": f"Question {i}"}, {"role": "assistant", "content": "a"},
              {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "b"}] for i in range(5)]
    src.write_text("".join(json.dumps({"id": i, "conversations": c}) + "\n" for i, c in enumerate(convs)))
    common = ["--model", str(mdir), "--data", str(src), "--max-tokens", "5", "--device", "cpu", "--max-turns", "1"]
    # chunks of 1 conversation through a batch of 1, or everything in one engine call: the same greedy text
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(common + ["--out", str(a), "--batch-size", "1", "--chunk", "1"]) == 0
    assert main(common + ["--out", str(b), "--batch-size", "4"]) == 0
    # requests admitted two at a time (`--min-admit`), with a small prefill budget: the same text again
    d = tmp_path / "d.jsonl"
    assert main(common + ["--out", str(d), "--batch-size", "2", "--min-admit", "2", "--max-batched-tokens", "64"]) == 0
    ra, rb, rd = ([json.loads(x) for x in open(p)] for p in (a, b, d))
    assert ra == rb == rd and len(ra) == 5
    assert all([m["role"] for m in r["conversations"]] == ["user", "assistant"] for r in ra)
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["generated_tokens"] > 0 and info["stopped"] is None
    # a spent time budget writes nothing more and says why
    c = tmp_path / "c.jsonl"
    assert main(common + ["--out", str(c), "--time-budget", "0"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["conversations"] == 0 and info["stopped"] == "time_budget=0.0s"
    for bad in (["--batch-size", "0"], ["--min-admit", "0"], ["--max-batched-tokens", "0"]):
        with pytest.raises(SystemExit):
            main(common + ["--out", str(c)] + bad)


@interpreted_only
def test_fast_target_gives_the_reference_features(tiny_setup, monkeypatch):
    """The trainer runs the frozen target on the fused inference kernels on a GPU (here under the Triton
    interpreter): the features and targets the draft learns from equal the eager reference's."""
    import copy
    import eyas.kernels
    from eyas.models.fused import enable_fast_path
    from eyas.train.trainer import draft_inputs
    _, _, target = tiny_setup
    calls = []
    rope = eyas.kernels.rope_triton
    monkeypatch.setattr(eyas.kernels, "rope_triton", lambda *a, **k: (calls.append(1), rope(*a, **k))[1])
    fast = enable_fast_path(copy.deepcopy(target))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=g)
    amask = torch.rand(3, 20, generator=g) < 0.5
    ref = draft_inputs(target, ids, amask)
    out = draft_inputs(fast, ids, amask)
    assert calls and hasattr(fast.model.layers[0].self_attn, "qkv_proj")  # the fused path did run
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.xz"])
def test_conversation_files_round_trip_plain_gzip_and_xz(tmp_path, suffix):
    from eyas.train.data import open_text, read_jsonl
    recs = [{"id": i, "conversations": [{"role": "user", "content": f"q{i} é"}]} for i in range(3)]
    path = tmp_path / "sub" / f"data{suffix}"
    with open_text(path, "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    assert list(read_jsonl(path)) == recs
    magic = path.read_bytes()[:6]
    assert magic[:2] == b"\x1f\x8b" if suffix.endswith(".gz") else True
    assert magic == b"\xfd7zXZ\x00" if suffix.endswith(".xz") else True
