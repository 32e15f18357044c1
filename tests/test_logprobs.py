"""Log-probabilities of the output tokens (`SamplingParams.logprobs`, eyas.layers.logprobs): every token's and its top
k's equal a dense forward's log-softmax over the whole output (the oracle), whatever produced the token: plain
decoding, chains, trees, dynamic trees, greedy or sampled; and a speculative run's equal plain decoding's."""
import pytest
import torch

from eyas import LLM, SamplingParams
from helpers import write_mirror_and_random

SPECS = [None, "chain:4", "tree:mc_sim_7b_63", "dyn:k3d4n8"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_mirror_and_random(tmp_path_factory)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 24, (n,), generator=g).tolist() for n in (1, 5, 9, 17)]


def _dense(llm, ids: list[int], n_prompt: int) -> torch.Tensor:
    """log-softmax of the target's logits at the positions that predicted each output token: [n_out, V]."""
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = llm.target.compute_logits(llm.target(t, torch.arange(len(ids))[None]))
    return torch.log_softmax(logits[0].float(), -1)[n_prompt - 1: len(ids) - 1]


@pytest.mark.parametrize("pair", ["mirror", "random"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_equal_a_dense_forwards(pairs, pair, spec, temperature):
    target, draft = pairs[pair]
    kw = dict(device="cpu", dtype="float32", block_size=4)
    if spec is not None:
        kw.update(draft=str(draft), speculation=spec)
    llm = LLM(str(target), **kw)
    params = [SamplingParams(temperature=temperature, max_tokens=20, seed=3, ignore_eos=True, logprobs=k)
              for k in (0, 3, 5, None)]
    outs = llm.generate(_prompts(), params)
    if spec is not None and pair == "mirror" and temperature == 0.0:  # long paths accepted: deep rows read
        assert sum(o.stats.committed for o in outs) > 1.5 * sum(o.stats.target_calls for o in outs)
    for p, o, sp in zip(_prompts(), outs, params):
        if sp.logprobs is None:
            assert o.logprobs is None
            continue
        assert len(o.logprobs) == len(o.token_ids) == 20
        ref = _dense(llm, p + o.token_ids, len(p))
        got = torch.tensor([e.logprob for e in o.logprobs])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0], atol=1e-5, rtol=0)
        top_lp, top_ids = ref.topk(sp.logprobs, dim=-1)
        assert all(len(e.top) == sp.logprobs for e in o.logprobs)
        torch.testing.assert_close(torch.tensor([[lp for _, lp in e.top] for e in o.logprobs]).reshape(top_lp.shape),
                                   top_lp, atol=1e-5, rtol=0)
        if temperature == 0.0:  # the greedy token is the likeliest
            assert all(e.top[0][0] == t for e, t in zip(o.logprobs, o.token_ids) if e.top)


def test_stops_cut_the_logprobs_with_the_tokens(pairs):
    """Tokens a stop token or max_tokens drops from an accepted run take their log-probabilities with them."""
    target, draft = pairs["mirror"]
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="chain:4")
    ref = llm.generate(_prompts(), SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2))
    stop = ref[2].token_ids[5]
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=7, stop_token_ids=[stop], logprobs=2))
    for o, r in zip(outs, ref):
        assert len(o.logprobs) == len(o.token_ids) <= 7
        kept = r.logprobs[:len(o.token_ids)]  # the same up to float noise (another batch, prefix-cache hits)
        assert [[i for i, _ in e.top] for e in o.logprobs] == [[i for i, _ in e.top] for e in kept]
        assert [e.logprob for e in o.logprobs] == pytest.approx([e.logprob for e in kept], abs=1e-5)


@pytest.mark.parametrize("spec", [None, "tree:mc_sim_7b_63"])
def test_prompt_logprobs_equal_a_dense_forward(pairs, spec):
    """`prompt_logprobs`: each prompt token's log-probability given those before it, and its top k, equal a dense
    forward's over the prompt (None for the first token); across prefill chunks (a 6-token budget splits the long
    prompts), beside requests that do not ask, after a preemption (a pool too small for all), and with prefix
    caching on (a request that asks takes no cached block: every position is computed; one that does not still
    hits what the others cached)."""
    target, draft = pairs["mirror"]
    kw = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=6)
    if spec is not None:
        kw.update(draft=str(draft), speculation=spec)
    prompts = _prompts() + [_prompts()[3] + [7, 7, 1]]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=k) for k in (2, 0, 4, 3)] + \
        [SamplingParams(max_tokens=12, ignore_eos=True)]
    for num_blocks in (None, 14):
        llm = LLM(str(target), num_blocks=num_blocks, **kw)
        outs = llm.generate(prompts, params)
        if num_blocks is not None:
            assert llm.engine.scheduler.num_preemptions > 0
        for p, o, sp in zip(prompts, outs, params):
            if sp.prompt_logprobs is None:
                assert o.prompt_logprobs is None
                continue
            assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
            ref = _dense(llm, p, 1)[: len(p) - 1]  # positions 0..len-2 predict tokens 1..len-1
            got = o.prompt_logprobs[1:]
            torch.testing.assert_close(torch.tensor([e.logprob for e in got]),
                                       ref.gather(1, torch.tensor(p[1:])[:, None])[:, 0], atol=1e-5, rtol=0)
            top_lp, top_ids = ref.topk(sp.prompt_logprobs, dim=-1)
            assert [[i for i, _ in e.top] for e in got] == top_ids.tolist()
            torch.testing.assert_close(torch.tensor([[lp for _, lp in e.top] for e in got]).reshape(top_lp.shape),
                                       top_lp, atol=1e-5, rtol=0)
        if num_blocks is None:
            assert outs[4].num_cached_tokens > 0  # the same prompt's blocks, cached by request 3
            again = llm.generate([prompts[3]], params[3])[0]  # its blocks are cached now: it takes none
            assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(prompts[3])
            assert [e.logprob for e in again.prompt_logprobs[1:]] == \
                pytest.approx([e.logprob for e in outs[3].prompt_logprobs[1:]], abs=1e-5)
        assert llm.engine.blocks.num_used == 0


def test_bad_logprobs_are_refused():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
