"""`eyas.kernels.spec_prologue`: the speculative step's index work in two launches, held to the PyTorch ops that
`spec_step` runs without them (interpreted on the CPU, compiled on a GPU), and the engine with
`eyas.spec.step.FUSED_PROLOGUE` on against non-speculative decoding."""
import os

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eyas import LLM, SamplingParams  # noqa: E402
from eyas.kernels.spec_prologue import (root_row_reference, root_row_triton, step_indices_reference,  # noqa: E402
                                        step_indices_triton)
from eyas.spec.tree import resolve_tree  # noqa: E402
from helpers import SHORT_CONTEXT, write_mirror_pair  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), P=st.integers(1, 7), spec=st.sampled_from(["chain:3", "tree:8", "tree:smollm2_48d5"]),
       seed=st.integers(0, 2**16))
def test_step_indices_equal_the_torch_ops(B, P, spec, seed):
    g = torch.Generator().manual_seed(seed)
    depth = resolve_tree(spec).depth.to(DEV)
    root = torch.randint(0, 49152, (B,), generator=g).to(DEV)
    n = torch.randint(1, 5000, (B,), generator=g).to(DEV)
    lens = torch.randint(0, P + 1, (B,), generator=g).to(DEV)  # 0: a padded row of a graph's batch
    got = step_indices_triton(root, n, lens, depth, P)
    want = step_indices_reference(root, n, lens, depth, P)
    assert torch.equal(got[0][:, 0], want[0][:, 0]) and got[0].shape == want[0].shape  # the levels fill the rest
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [48, 576, 1500])
def test_root_row_equals_the_gather(dtype, H):
    g = torch.Generator().manual_seed(H)
    B, P = 3, 5
    out = torch.randn(B, P, H, generator=g).to(dtype).to(DEV)
    lens = torch.tensor([0, 5, 2], device=DEV)
    node_h = torch.full((B, 4, H), float("nan"), dtype=dtype, device=DEV)
    got = root_row_triton(out, lens, node_h[:, 0])
    assert got.data_ptr() == node_h.data_ptr() and torch.equal(got, root_row_reference(out, lens))
    assert torch.isnan(node_h[:, 1:]).all()  # only row 0 written
    with pytest.raises(ValueError, match="contiguous rows"):
        root_row_triton(out, lens, node_h[:, :, 0])


def test_step_indices_refuse_bad_shapes():
    z = torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="P >= 1"):
        step_indices_triton(z, z, z[:1], resolve_tree("chain:3").depth.to(DEV), 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("prologue"))  # a draft that is mostly accepted


@pytest.mark.parametrize("spec", ["chain:3", "tree:8"])
def test_engine_with_the_fused_prologue_equals_plain_decoding(tiny, monkeypatch, spec):
    """`FUSED_PROLOGUE` on, the Triton path (interpreted on the CPU): greedy speculative decoding of two prompts gives
    non-speculative decoding's tokens, every step took the two launches, and the draft proposed what it proposes
    without them (the same target calls: its positions and mask are the same)."""
    import eyas.kernels.spec_prologue as sp
    from eyas.spec import step
    target, draft = tiny
    prompts = [[1, 2, 3, 4, 5], [9, 8]]  # (vocabulary 24)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(target), device=DEV, dtype="float32").generate(prompts, params)]
    calls = []
    for name in ("step_indices_triton", "root_row_triton"):
        f = getattr(sp, name)
        monkeypatch.setattr(sp, name, lambda *a, _f=f, _n=name, **k: calls.append(_n) or _f(*a, **k))
    runs = {}
    for fused in (False, True):  # the unfused run on the PyTorch path: the interpreted kernels are CI's slowest part
        monkeypatch.setattr(step, "FUSED_PROLOGUE", fused)
        llm = LLM(str(target), device=DEV, dtype="float32", draft=str(draft), speculation=spec,
                  max_model_len=SHORT_CONTEXT)
        llm.engine.runner.use_triton = fused
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        runs[fused] = [o.stats.target_calls for o in outs]
        assert sum(o.stats.committed for o in outs) > sum(runs[fused])  # the draft was heard
        assert calls.count("step_indices_triton") == calls.count("root_row_triton") >= (3 if fused else 0)
    assert runs[True] == runs[False]



@pytest.mark.parametrize("switch", ["FUSED_SAMPLED_ROUNDS", "SORT_FREE_FILTERS"])
def test_engine_with_a_sampling_switch_samples_the_same_tokens(tiny, monkeypatch, switch):
    """The Triton path (interpreted on the CPU) with `eyas.spec.step.FUSED_SAMPLED_ROUNDS` (the rounds and walk in
    one launch) or `SORT_FREE_FILTERS` (the filters' thresholds by radix selection) on: seeded sampled requests, and a
    greedy one, beside each other, sample the tokens of the same path with it off (float32 logits: no ties at a
    filter's boundary, where the two filter rules could differ), and every step took the new launch."""
    import eyas.kernels.accept_sampled as acc
    from eyas.spec import step
    target, draft = tiny
    prompts = [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7]]
    if switch == "FUSED_SAMPLED_ROUNDS":
        mod, fn = acc, "accept_rounds_triton"
        params = [SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True),
                  SamplingParams(max_tokens=5, temperature=0.6, seed=4, ignore_eos=True),
                  SamplingParams(max_tokens=5, ignore_eos=True)]
    else:  # the step's filtered acceptance from the logits (the prefill's first token takes the threshold either way)
        mod, fn = step, "accept_tree_logits"
        params = [SamplingParams(max_tokens=5, temperature=1.0, top_p=0.8, seed=3, ignore_eos=True),
                  SamplingParams(max_tokens=5, temperature=0.7, top_k=5, seed=4, ignore_eos=True),
                  SamplingParams(max_tokens=5, temperature=1.2, min_p=0.05, seed=5, ignore_eos=True)]
    calls = []
    f = getattr(mod, fn)

    def counted(*a, **k):
        if mod is acc or k.get("filters") is not None:
            calls.append(1)
        return f(*a, **k)

    monkeypatch.setattr(mod, fn, counted)
    monkeypatch.setattr(step, "COUPLED", False)  # the switches choose among the rounds' paths
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(step, switch, on)
        llm = LLM(str(target), device=DEV, dtype="float32", draft=str(draft), speculation="chain:3",
                  max_model_len=SHORT_CONTEXT)
        llm.engine.runner.use_triton = True
        outs = llm.generate(prompts, params)
        runs[on] = ([o.token_ids for o in outs], [o.stats.target_calls for o in outs])
        assert len(calls) >= 2 if on else not calls
    assert runs[True] == runs[False]


def test_coupled_acceptance_on_triton_samples_plain_decodings_tokens(tiny, monkeypatch):
    """`eyas.spec.step.COUPLED` on the Triton path (interpreted on the CPU: the race over every node, the filters'
    thresholds, the greedy walk's launch): seeded sampled requests, filtered and not, and a greedy one, take plain
    decoding's tokens, and every step accepted through `race_winners`."""
    from eyas.spec import step
    target, draft = tiny
    prompts = [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7], [4, 4]]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, top_p=0.8, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.2, top_k=5, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True)]
    plain = LLM(str(target), device=DEV, dtype="float32", max_model_len=SHORT_CONTEXT)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    calls = []
    winners = step.race_winners
    monkeypatch.setattr(step, "race_winners", lambda *a, **k: calls.append(a[5]) or winners(*a, **k))
    llm = LLM(str(target), device=DEV, dtype="float32", draft=str(draft), speculation="chain:3",
              max_model_len=SHORT_CONTEXT)
    llm.engine.runner.use_triton = True
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert calls and all(calls)  # every sampled step, on the Triton path


@pytest.mark.parametrize("filtered", [False, True])
def test_the_first_tokens_race_alike_on_triton_and_torch(filtered):
    """The token after a prompt (`ModelRunner._first_tokens`: an exponential race on the logits, among the tokens
    the filters keep): the Triton path (the race and radix-selection kernels) draws the torch path's tokens, greedy
    rows take the argmax, and filtered rows draw only kept tokens."""
    from types import SimpleNamespace
    from eyas.engine.runner import ModelRunner
    from eyas.layers.sampler import filter_threshold
    g = torch.Generator().manual_seed(int(filtered))
    logits = (torch.randn(6, 300, generator=g) * 3).to(DEV)
    temps = [0.0, 0.5, 1.0, 1.0, 1.5, 0.7]
    params = [SamplingParams(temperature=t, seed=i, top_p=0.6 if filtered and i % 2 else 1.0,
                             top_k=4 if filtered and i == 4 else -1) for i, t in enumerate(temps)]
    seeds, counters = torch.arange(6, device=DEV), torch.tensor([3, 9, 27, 4, 4, 100], device=DEV)
    got = [ModelRunner._first_tokens(SimpleNamespace(use_triton=u), logits, params, seeds, counters).cpu()
           for u in (False, True)]
    assert torch.equal(got[0], got[1])
    assert got[0][0] == logits[0].argmax().cpu()
    p = [torch.tensor([getattr(x, f) for x in params]) for f in ("temperature", "top_k", "top_p", "min_p")]
    tau = filter_threshold(logits.cpu(), *p)[0]
    x = logits.cpu() / torch.tensor(temps).clamp(min=1e-9)[:, None]
    assert bool((x[torch.arange(1, 6), got[0][1:]] >= tau[1:]).all())
    if filtered:  # the filters bit: some row kept fewer tokens than it has
        assert bool(((x >= tau[:, None]).sum(-1)[1:] < 300).any())
