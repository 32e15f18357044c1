"""Lossless sampling: with a tiny target (vocabulary 6) at temperature 1 and with top-p 0.8, the joint law of the
first 3 generated tokens over 20,000 seeded runs matches the exact law enumerated from the target alone
(chi-square), with a random draft, with a deliberately bad one, with the random draft restricted to a reduced
draft vocabulary, and with n-gram proposals (no draft model)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from eyas import LLM, SamplingParams
from helpers import write_eagle3_draft, write_random_draft, write_tiny_llama

V = 6
PROMPT = [1, 4, 2]
RUNS = 20_000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    target = write_tiny_llama(d / "t", vocab=V, hidden=32, heads=4, kv_heads=2, layers=2, seed=5)
    random_draft = write_random_draft(d / "rd", target, seed=2, scale=1.0)
    bad_draft = write_random_draft(d / "bd", target, seed=3, scale=30.0)  # confidently wrong
    subset_draft = write_random_draft(d / "sd", target, seed=2, scale=1.0)
    from eyas.spec.draft_vocab import save_draft_vocab
    save_draft_vocab(subset_draft, torch.tensor([0, 2, 5]))  # proposes only 3 of the 6 tokens
    return target, {"random": random_draft, "bad": bad_draft, "subset": subset_draft}


def target_probs(hf, prefix, top_p, min_p=0.0):
    """Next-token law after temperature 1, min-p and top-p, in float64, from HF transformers' forward."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double().numpy()
    p = np.exp(logits - logits.max())
    p /= p.sum()
    if min_p > 0:  # the tokens at least min_p times as likely as the likeliest
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = order[before < top_p]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def exact_joint(target_dir, top_p, min_p=0.0):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    joint = {}
    p1 = target_probs(hf, (), top_p, min_p)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = target_probs(hf, (a,), top_p, min_p)
        for b in range(V):
            if p2[b] == 0:
                continue
            p3 = target_probs(hf, (a, b), top_p, min_p)
            for c in range(V):
                joint[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return joint


def sampled_law(target, draft, spec: str, **params) -> tuple[dict, list]:
    """RUNS seeded runs of 3 tokens from PROMPT at temperature 1 (`params`: more SamplingParams), speculating with
    `draft` (a directory or "ngram:...") by `spec`: (how often each 3-token output came, the outputs)."""
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec,
              max_num_seqs=RUNS, num_blocks=RUNS + 8, block_size=8)
    outs = llm.generate([PROMPT] * RUNS, [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True,
                                                         **params) for s in range(RUNS)])
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    return counts, outs


@pytest.mark.slow
@pytest.mark.parametrize("draft_kind", ["random", "bad", "subset"])
@pytest.mark.parametrize("top_p,spec", [(1.0, "tree:8"), (0.8, "chain:2"), (1.0, "dyn:k3d3n6")])
def test_joint_law_of_three_tokens(models, draft_kind, top_p, spec):
    target, drafts = models
    counts, outs = sampled_law(target, drafts[draft_kind], spec, top_p=top_p)
    joint = exact_joint(target, top_p)
    assert set(counts) <= set(joint), "a token outside the top-p set was emitted"
    p = pooled_chisquare(counts, joint, RUNS)
    assert p > 1e-3, p
    # speculation did something: some draft tokens were accepted (random draft), or none (bad draft)
    accepted = sum(sum(o.stats.accepted_by_depth) for o in outs)
    if draft_kind in ("random", "subset"):
        assert accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("top_p,spec", [(1.0, "tree:8"), (0.8, "chain:2")])
def test_joint_law_of_the_rounds_path(models, top_p, spec, monkeypatch):
    """With `eyas.spec.step.COUPLED` off, sampled steps accept by multi-round speculative sampling's own draws
    (`accept_tree_logits`, `accept_tree`): the same law."""
    from eyas.spec import step
    monkeypatch.setattr(step, "COUPLED", False)
    target, drafts = models
    counts, outs = sampled_law(target, drafts["random"], spec, top_p=top_p)
    joint = exact_joint(target, top_p)
    assert set(counts) <= set(joint)
    assert pooled_chisquare(counts, joint, RUNS) > 1e-3
    assert sum(sum(o.stats.accepted_by_depth) for o in outs) > 0


@pytest.mark.slow
def test_joint_law_with_an_eagle3_draft(models, tmp_path):
    """An EAGLE-3 checkpoint's draft (its own head over every other token, the inputs of the target's two layers),
    tree:8 at temperature 1 (the sampler's softmax path): the output's law is still the target's."""
    target, _ = models
    draft = write_eagle3_draft(tmp_path / "e3", target, draft_vocab=3, aux_ids=[1, 2])
    counts, outs = sampled_law(target, draft, "tree:8")
    assert pooled_chisquare(counts, exact_joint(target, 1.0), RUNS) > 1e-3
    assert sum(sum(o.stats.accepted_by_depth) for o in outs) > RUNS // 10  # its proposals were accepted


def test_joint_law_with_ngram_proposals(models):
    """N-gram speculation (`draft="ngram:1:2"`, chain:2): its proposals are the history's own tokens, which often
    repeat over 6 tokens, and the output's law is still the target's."""
    target, _ = models
    counts, outs = sampled_law(target, "ngram:1:2", "chain:2")
    assert pooled_chisquare(counts, exact_joint(target, 1.0), RUNS) > 1e-3
    assert sum(sum(o.stats.accepted_by_depth) for o in outs) > RUNS // 10  # proposals were accepted


@pytest.mark.parametrize("spec", ["tree:8", "chain:2"])
def test_joint_law_with_min_p(models, spec):
    """min-p 0.15 (vLLM's): the tokens less than 0.15 times as likely as the likeliest never come, and the rest
    follow the renormalised law."""
    target, drafts = models
    counts, _ = sampled_law(target, drafts["random"], spec, min_p=0.15)
    joint = {k: v for k, v in exact_joint(target, 1.0, 0.15).items() if v > 0}
    assert set(counts) <= set(joint), "a token below min-p was emitted"
    assert len(joint) < 0.8 * V ** 3  # min-p removed some paths: the test has power
    assert pooled_chisquare(counts, joint, RUNS) > 1e-3


def test_min_p_by_hand():
    from eyas.layers.sampler import logits_to_probs
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    one = torch.ones(1)
    got = logits_to_probs(p.log(), one, torch.zeros(1, dtype=torch.long), one, torch.tensor([0.4]))
    torch.testing.assert_close(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))  # 0.15 < 0.4 * 0.5
    free = logits_to_probs(p.log(), one, torch.zeros(1, dtype=torch.long), one, torch.zeros(1))
    torch.testing.assert_close(free, p)
    for bad in (-0.1, 1.5, "0.2"):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)


def pooled_chisquare(counts: dict, joint: dict, runs: int) -> float:
    """Chi-square p-value of observed counts against the exact joint law; cells expecting < 5 are pooled."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k in sorted(joint, key=lambda k: -joint[k]):
        e = joint[k] * runs
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            rest_o += counts.get(k, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    exp = np.array(exp) * (runs / np.sum(exp))
    return chisquare(obs, exp)[1]


def test_the_test_has_power(models):
    """A sampler off by temperature 1.1 instead of 1 (a classic bug) is rejected at 20,000 runs, while exact
    multinomial draws from the true law pass."""
    target, _ = models
    joint = exact_joint(target, 1.0)
    keys = list(joint)
    p = np.array([joint[k] for k in keys])
    rng = np.random.default_rng(0)
    exact = rng.multinomial(RUNS, p / p.sum())
    assert pooled_chisquare(dict(zip(keys, exact)), joint, RUNS) > 1e-3
    tempered = p ** (1 / 1.1)
    biased = rng.multinomial(RUNS, tempered / tempered.sum())
    assert pooled_chisquare(dict(zip(keys, biased)), joint, RUNS) < 1e-3


def test_sample_from_is_the_inverse_cdf_on_integers():
    """sample_from on the fixed-point CDF equals a float64 inverse CDF away from the boundaries, and draws only tokens
    with mass; fixed_point_cumsum is exact integer arithmetic."""
    from eyas.layers.sampler import fixed_point_cumsum, sample_from
    g = torch.Generator().manual_seed(3)
    p = torch.rand(4, 1000, generator=g) ** 4
    p[1, ::2] = 0.0  # tokens without mass are never drawn
    q, cum = fixed_point_cumsum(p)
    assert q.dtype == torch.int64 and torch.equal(cum, torch.cumsum(q, -1)) and int(q.max()) == 1 << 32
    u = torch.rand(4, generator=g).clamp(1e-6, 1 - 1e-6)
    for j in range(200):
        uj = (u + j / 200) % 1
        got = sample_from(p, uj)
        ref = torch.searchsorted(p.double().cumsum(-1), (uj.double() * p.double().sum(-1))[:, None],
                                 right=True).squeeze(-1)
        assert torch.equal(got, ref)
        assert bool((p[torch.arange(4), got] > 0).all())


def test_the_race_draws_the_softmax():
    """`race_sample` (the bonus and plain sampled tokens since session 59) draws softmax(logits / t) renormalised over
    the tokens not excluded: 60,000 draws of one 6-token row (a seed each), chi-square against the exact law, at two
    temperatures; the same counts against the untempered law fail (the test has power). Greedy rows take the argmax."""
    from scipy.stats import chisquare

    from eyas.layers.sampler import RACE_BASE, race_sample
    n = 60_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(n, 6)
    exclude = torch.tensor([[1, -1]]).expand(n, 2)
    seeds, counters = torch.arange(n), torch.full((n,), 5)
    base = torch.full((n,), RACE_BASE)
    for t in (1.0, 0.6):
        got = race_sample(logits, torch.full((n,), t), seeds, counters, base, exclude)
        counts = torch.bincount(got, minlength=6).double()
        assert counts[1] == 0
        law = torch.softmax(logits[0].double() / t, -1)
        law[1] = 0
        law /= law.sum()
        keep = law > 0
        assert chisquare(counts[keep], n * law[keep])[1] > 1e-3
        flat = torch.softmax(logits[0].double(), -1)
        flat[1] = 0
        flat /= flat.sum()
        if t != 1.0:
            assert chisquare(counts[keep], n * flat[keep])[1] < 1e-3
    greedy = race_sample(logits[:4], torch.zeros(4), seeds[:4], counters[:4], base[:4], exclude[:4])
    assert greedy.tolist() == [0, 0, 0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_is_reproducible_bit_for_bit_on_cuda():
    """One row of a 128k vocabulary (a 1-row float cumsum runs CUB's look-back scan, not reproducible): the same
    logits and uniforms give the same tokens and top-p sets every time. Tensor-parallel ranks rely on it."""
    from eyas.layers.sampler import logits_to_probs, sample_from
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(1, 128256, device="cuda", generator=g) * 3).bfloat16().float()  # bf16: many ties
    t, k, p = (torch.tensor([1.0], device="cuda"), torch.tensor([0], device="cuda"), torch.tensor([0.9], device="cuda"))
    u = torch.rand(64, device="cuda", generator=g)
    first_probs = logits_to_probs(logits, t, k, p)
    first = torch.stack([sample_from(first_probs, u[i:i + 1]) for i in range(64)])
    float_cdfs = set()
    for _ in range(50):
        probs = logits_to_probs(logits, t, k, p)
        assert torch.equal(probs, first_probs)
        assert torch.equal(torch.stack([sample_from(probs, u[i:i + 1]) for i in range(64)]), first)
        float_cdfs.add(probs.cumsum(-1)[0, -1].item())
    print(f"distinct totals of the float cumsum over 50 runs: {len(float_cdfs)}")


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(2, 300), scale=st.floats(0.1, 20.0), seed=st.integers(0, 2 ** 16))
def test_the_softmax_path_equals_the_filters_turned_off(rows, vocab, scale, seed):
    """`logits_to_probs(filters=False)` (no sort: the requests ask for no top-k, top-p or min-p) against the general
    path with every filter off, its reference: greedy rows the same one-hot, sampled rows the same law (up to the
    order of the softmax's additions), at any temperature."""
    from eyas.layers.sampler import logits_to_probs
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    temperature = torch.tensor([[0.0, 0.3, 1.0, 1.7][(seed + i) % 4] for i in range(rows)])
    off = (torch.full((rows,), -1), torch.ones(rows), torch.zeros(rows))
    fast = logits_to_probs(logits, temperature, *off, filters=False)
    ref = logits_to_probs(logits, temperature, *off)
    greedy = temperature == 0
    assert torch.equal(fast[greedy], ref[greedy]) and bool((fast[greedy].sum(-1) == 1).all())
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-7)


def test_sampling_modes():
    """The host's flag that picks the softmax path (and a step's graphs): filters of greedy requests do not count."""
    from eyas.layers.sampler import filters_of, sampling_mode
    greedy, plain = SamplingParams(temperature=0.0, top_k=5, top_p=0.5), SamplingParams(temperature=0.7)
    assert sampling_mode([greedy, SamplingParams(temperature=0.0)]) == "greedy" and not filters_of([greedy])
    assert sampling_mode([greedy, plain]) == "sampled"
    for filt in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)):
        assert sampling_mode([plain, SamplingParams(temperature=1.0, **filt)]) == "filtered", filt
