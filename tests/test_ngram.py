"""N-gram speculation (`eyas.spec.ngram`, `draft="ngram"`): proposals from the sequence's own earlier tokens.

Oracles: a plain loop for the proposals; plain decoding for greedy output (token for token); the law enumerated from
HF transformers for sampled output (`tests/test_spec_distribution.py`)."""
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas import LLM, SamplingParams
from eyas.spec.ngram import NgramProposer, propose, propose_reference
from helpers import write_tiny_llama


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 3))
def test_proposals_equal_the_loop(tokens, k, n_min, extra):
    """Over a 4-token alphabet (many matches, overlapping ones, matches that run into the end)."""
    n_max = n_min + extra
    assert propose(tokens, k, n_min, n_max) == propose_reference(tokens, k, n_min, n_max)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.lists(st.integers(1, 5), min_size=1, max_size=20),
       st.integers(1, 3), st.integers(0, 2))
def test_the_index_equals_the_scan_as_tokens_grow(tokens, steps, n_min, extra):
    """`NgramIndex` (what the engine uses), fed a sequence as it grows by a few tokens a step, proposes what a scan
    of the whole sequence does at every step; given a shorter sequence it starts afresh."""
    from eyas.spec.ngram import NgramIndex
    n_max = n_min + extra
    index, L = NgramIndex(n_min, n_max), 0
    for s in steps:
        L = min(len(tokens), L + s)
        assert index.propose(tokens[:L], 3) == propose(tokens[:L], 3, n_min, n_max), L
    assert index.propose(tokens[:1], 2) == propose(tokens[:1], 2, n_min, n_max) is None


def test_proposals_by_hand():
    assert propose([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # after the earlier "1 2"
    assert propose([7, 1, 2, 5, 1, 2, 6, 1, 2], 2) == [6, 1]  # the most recent occurrence
    assert propose([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3], 2) == [8, 5]  # the longest n first ("1 2 3"), not the later "2 3"
    assert propose([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a repetition continues with its period
    assert propose([1, 2, 3, 4], 3) is None and propose([4], 2) is None
    assert propose([1, 2, 3, 4, 3], 2, n_min=1) == [4, 3]  # unigrams with n_min 1
    with pytest.raises(ValueError, match="n_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="ngram:N_MIN:N_MAX"):
        NgramProposer.parse("ngram:3")
    assert NgramProposer.parse("ngram:1:5") == NgramProposer(1, 5) and NgramProposer.parse("ngram").n_max == 4


def write_bigram_llama(path: Path, vocab=24, seed=0) -> Path:
    """A tiny Llama whose attention outputs are zeroed (o_proj = 0): its next token depends on the current token
    only, so greedy output falls into a cycle, which n-gram proposals then follow."""
    from safetensors.torch import load_file, save_file
    write_tiny_llama(path, vocab=vocab, hidden=32, heads=4, kv_heads=2, layers=2, seed=seed)
    sd = load_file(str(path / "model.safetensors"))
    for k in sd:
        if k.endswith("o_proj.weight"):
            sd[k] = torch.zeros_like(sd[k])
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ngram")
    return {"bigram": write_bigram_llama(d / "b"),
            "random": write_tiny_llama(d / "r", vocab=24, hidden=32, heads=4, kv_heads=2, layers=2, seed=3)}


PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 9, 5, 9, 5], [7], [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]


@pytest.mark.parametrize("kind", ["bigram", "random"])
@pytest.mark.parametrize("spec", ["ngram", "ngram:1:3"])
def test_greedy_ngram_equals_plain(models, kind, spec):
    """Greedy output with n-gram speculation (chain:4 and chain:2; a small pool, so that requests are preempted and
    prefilled again) equals plain decoding's; on the bigram model, whose output cycles, most tokens come from
    accepted proposals; steps where no sequence has a proposal are plain steps."""
    path = str(models[kind])
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, device="cpu", dtype="float32").generate(PROMPTS, params)]
    for speculation in (None, "chain:2"):
        llm = LLM(path, device="cpu", dtype="float32", draft=spec, speculation=speculation, num_blocks=30,
                  block_size=4)
        outs = llm.generate(PROMPTS * 2, params)
        assert [o.token_ids for o in outs] == ref * 2, (kind, spec, speculation)
        eng = llm.engine
        assert eng.blocks.num_used == 0 and eng.scheduler.num_preemptions > 0
        assert eng.tree.name == (speculation or "chain:4")
        accepted = sum(sum(o.stats.accepted_by_depth) for o in outs)
        committed = sum(o.stats.committed for o in outs)
        if kind == "bigram":
            assert accepted > 0.5 * committed, (accepted, committed)
    assert set(eng.runner.tree_steps) <= {"chain:2", "chain:0"}


def test_ngram_needs_a_chain(models):
    path = str(models["random"])
    with pytest.raises(ValueError, match="chain"):
        LLM(path, device="cpu", dtype="float32", draft="ngram", speculation="tree:8")
    with pytest.raises(ValueError, match="draft model"):
        LLM(path, device="cpu", dtype="float32", draft="ngram", draft_quant="fp8")
    with pytest.raises(ValueError, match="ngram:N_MIN:N_MAX"):
        LLM(path, device="cpu", dtype="float32", draft="ngram:2")


def test_ngram_with_guides_penalties_and_logprobs(tmp_path):
    """N-gram proposals under a guide (each node masked by the grammar state its path reaches), with penalties (each
    node penalised by its own path) and log-probabilities: greedy tokens and log-probabilities equal plain
    decoding's, batched with free requests."""
    from eyas import GuidedDecoding
    from helpers import write_guided_mirror
    target, _, _ = write_guided_mirror(tmp_path)
    params = [SamplingParams(max_tokens=40, guided=GuidedDecoding(regex=r"(ab|c)+\.")),
              SamplingParams(max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.2, logprobs=2),
              SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=40, guided=GuidedDecoding(json_object=True), presence_penalty=0.5)]
    prompts = ["abcabcab", "Hello there Hello there", "yes or no? yes or no?", '{"']
    plain = LLM(str(target), device="cpu", dtype="float32").generate(prompts, params)
    ngram = LLM(str(target), device="cpu", dtype="float32", draft="ngram:1:3", speculation="chain:3")
    outs = ngram.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for a, b in zip(outs, plain):
        if b.logprobs is not None:
            assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in x.top] for x in b.logprobs]
            assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-4)
    assert sum(sum(o.stats.accepted_by_depth) for o in outs) > 0
