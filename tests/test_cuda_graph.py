"""The CUDA-graphed speculative step (with the Triton kernels) changes nothing: greedy output equals the eager
reference path (plain PyTorch attention), for plain decoding, chains and trees. GPU only."""
import math

import pytest
import torch

from eyas import LLM, SamplingParams
from helpers import feature_draft_from, write_mirror_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference_ops(llm):
    """The eager reference for norm/RoPE/SwiGLU too (the runner switched to the fused kernels on CUDA; the fused
    projections stay: tests/test_fused_ops.py holds them to the unfused ones)."""
    from eyas.models.fused import use_fused_ops
    for m in (llm.target, llm.engine.draft):  # (the engine's draft: None for n-gram proposals)
        if m is not None:
            use_fused_ops(m, False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], list(range(1, 20)), [7]]
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def eager_reference_and_graphed(target, draft, spec):
    """(greedy outputs of the eager reference path, an LLM with CUDA graphs) for PROMPTS."""
    kw = dict(device="cuda", dtype="float32", draft=str(draft) if spec else None, speculation=spec)
    eager = LLM(str(target), **kw)
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    return [o.token_ids for o in eager.generate(PROMPTS, PARAMS)], LLM(str(target), cuda_graphs=True, **kw)


# the dispatcher: 4 prompts run plain steps (the draft reads along), then tree:8 and mc_sim as the batch shrinks
@pytest.mark.parametrize("spec", [None, "chain:4", "tree:mc_sim_7b_63", "dispatch:1=tree:mc_sim_7b_63,2=tree:8,8=plain",
                                  "dyn:k3d4n8"])
def test_graphs_equal_eager(pair, spec):
    ref, graphed = eager_reference_and_graphed(*pair, spec)
    assert [o.token_ids for o in graphed.generate(PROMPTS, PARAMS)] == ref
    assert graphed.engine.runner.graphs.graphs  # a graph was captured and replayed
    assert graphed.engine.runner.prefill_graphs.graphs  # and the prefills' too
    assert [graphed.generate([p], PARAMS)[0].token_ids for p in PROMPTS] == ref  # bucket 1


@pytest.mark.parametrize("kind", ["bigram", "pair"])
def test_graphs_equal_eager_with_ngram_proposals(pair, kind, tmp_path):
    """N-gram speculation on graphs (the proposals are static inputs; steps without any are plain steps): greedy
    output equals the eager reference path's, on a model whose output cycles (most tokens from accepted proposals)
    and on the pair's target; sampled (seeded) output equals the eager Triton path's."""
    from test_ngram import write_bigram_llama
    target = write_bigram_llama(tmp_path / "b") if kind == "bigram" else pair[0]
    prompts = PROMPTS + [[1, 2, 3, 4, 1, 2, 3]]
    kw = dict(device="cuda", dtype="float32", draft="ngram", speculation="chain:4")
    eager = LLM(str(target), **kw)
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    ref = [o.token_ids for o in eager.generate(prompts, PARAMS)]
    graphed = LLM(str(target), cuda_graphs=True, **kw)
    g = graphed.engine.runner.graphs
    assert g.capture_all(len(prompts), modes=("greedy",)) > 0  # the plain steps' graphs among them
    captured = len(g.graphs)
    outs = graphed.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == ref
    assert len(g.graphs) == captured  # nothing was captured while decoding
    assert set(graphed.engine.runner.tree_steps) == {"chain:4", "chain:0"}
    if kind == "bigram":
        assert sum(sum(o.stats.accepted_by_depth) for o in outs) > 0.5 * sum(o.stats.committed for o in outs)
    sampled = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    triton = LLM(str(target), **kw)
    assert [o.token_ids for o in graphed.generate(prompts, sampled)] == \
        [o.token_ids for o in triton.generate(prompts, sampled)]


@pytest.mark.parametrize("spec", ["chain:4", "tree:8"])
def test_graphs_equal_eager_with_a_feature_layer_draft(pair, spec, tmp_path):
    """A draft with feature layers (the verify step also returns lower layers' features, fused at commit)."""
    from eyas.loader.resolve import load_target
    target, draft = pair
    t, _ = load_target(str(target), "cpu", "float32")
    fdraft = feature_draft_from(draft, t, tmp_path / "fd", feature_layers=(0,), noise=0.5)
    ref, graphed = eager_reference_and_graphed(target, fdraft, spec)
    assert [o.token_ids for o in graphed.generate(PROMPTS, PARAMS)] == ref


def test_graphs_equal_eager_with_a_draft_vocabulary(pair, tmp_path):
    """A draft restricted to 12 of the 24 tokens (`draft_vocab.safetensors`): its gathered head rows and id map are
    read inside the captured step."""
    import shutil
    from eyas.spec.draft_vocab import save_draft_vocab
    target, draft = pair
    vd = tmp_path / "vd"
    shutil.copytree(draft, vd)
    save_draft_vocab(vd, torch.arange(0, 24, 2))
    ref, graphed = eager_reference_and_graphed(target, vd, "tree:8")
    assert [o.token_ids for o in graphed.generate(PROMPTS, PARAMS)] == ref


@pytest.mark.parametrize("spec", ["chain:3", "tree:8", "dyn:k3d3n6"])
def test_graphs_equal_eager_with_an_eagle3_draft(tmp_path, spec):
    """An EAGLE-3 checkpoint's draft (eyas/models/eagle3.py: the target's raw taps, its 2H-wide first layer on the
    modules' path, its own head and d2t map) inside the captured step: greedy output as the eager reference path's,
    and seeded sampling (the "sampled" mode's graphs: no sort) as the eager Triton path's."""
    from helpers import write_eagle3_draft, write_tiny_llama
    target = write_tiny_llama(tmp_path / "t", vocab=48, hidden=32, heads=4, kv_heads=2, layers=8, seed=4)
    draft = write_eagle3_draft(tmp_path / "d", target, draft_vocab=20)
    prompts = [p[:12] for p in PROMPTS]
    ref, graphed = eager_reference_and_graphed(target, draft, spec)
    assert [o.token_ids for o in graphed.generate(PROMPTS, PARAMS)] == ref
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True) for i in range(len(prompts))]
    eager = LLM(str(target), device="cuda", dtype="float32", draft=str(draft), speculation=spec)
    assert [o.token_ids for o in graphed.generate(prompts, sampled)] == \
        [o.token_ids for o in eager.generate(prompts, sampled)]
    assert any(k[1] == "sampled" for k in graphed.engine.runner.graphs.graphs)


@pytest.mark.parametrize("spec", [None, "tree:8"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_graphs_equal_eager_on_qwen2(tmp_path, spec, kind):
    """A Qwen2 checkpoint (biases on q, k and v) and a Qwen3 one (per-head q and k norms), each with a random draft
    of its shape: the steps take the paths that allow them."""
    from helpers import write_random_draft
    from test_model_hf import write_tiny_qwen2, write_tiny_qwen3
    write = write_tiny_qwen2 if kind == "qwen2" else write_tiny_qwen3
    target = write(tmp_path / "q", vocab=24, layers=2)
    ref, graphed = eager_reference_and_graphed(target, write_random_draft(tmp_path / "d", target), spec)
    assert [o.token_ids for o in graphed.generate(PROMPTS, PARAMS)] == ref
    assert graphed.engine.runner.graphs.graphs


def test_capture_all_covers_every_bucket_a_shrinking_batch_needs(pair):
    target, draft = pair
    spec = "dispatch:1=chain:4,4=tree:8,64=plain"
    kw = dict(device="cuda", dtype="float32", draft=str(draft), speculation=spec)
    eager = LLM(str(target), **kw)
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    prompts = [[1 + i, 2, 3 + i] for i in range(8)]
    params = [SamplingParams(max_tokens=4 + 6 * i, ignore_eos=True) for i in range(8)]  # the batch shrinks 8 -> 1
    ref = [o.token_ids for o in eager.generate(prompts, params)]
    graphed = LLM(str(target), cuda_graphs=True, **kw)
    g = graphed.engine.runner.graphs
    # buckets 1 (chain:4), 2 and 4 (tree:8), 8 (plain: n = 5..8), each per context bucket (512 and the table's
    # width: max_model_len is 512)
    assert g.context_buckets == (512, g.width * graphed.engine.runner.block_size)
    assert g.capture_all(8, modes=("greedy",)) == 4 * 2
    assert g.capture_all(8, modes=("greedy",)) == 0
    assert [o.token_ids for o in graphed.generate(prompts, params)] == ref
    assert len(g.graphs) == 4 * 2  # nothing was captured while decoding


def test_temperature_bands_on_graphs_equal_eager(pair):
    """A dispatch with temperature bands under graphs: greedy and seeded hot requests together take the hot bands'
    trees (plain steps at 1, chain:3 at 0.6), the greedy request alone at the end the first band's, and hot requests
    alone plain steps without the draft; the tokens are eager decoding's, and `capture_all` captured every graph
    those steps needed beforehand."""
    target, draft = pair
    spec = "dispatch:2=tree:8,64=chain:2|0.5=chain:3|0.9=plain"
    params = [SamplingParams(max_tokens=45, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=1.0, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=35, temperature=0.6, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    kw = dict(device="cuda", dtype="float32", draft=str(draft), speculation=spec)
    eager = LLM(str(target), **kw)
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    ref = [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert {"chain:0", "chain:3", "tree:8"} <= set(eager.engine.runner.tree_steps), eager.engine.runner.tree_steps
    graphed = LLM(str(target), cuda_graphs=True, **kw)
    g = graphed.engine.runner.graphs
    n = g.capture_all(4, modes=("greedy", "sampled"))
    assert n > 0
    assert [o.token_ids for o in graphed.generate(PROMPTS, params)] == ref
    assert len(g.graphs) == n  # nothing was captured while decoding
    # requests at or above 0.9 alone: plain steps without the draft (the bare tree, "plain"), captured beforehand
    hot = [SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True),
           SamplingParams(max_tokens=15, temperature=0.95, seed=6, ignore_eos=True)]
    ref = [o.token_ids for o in eager.generate(PROMPTS[:2], hot)]
    assert [o.token_ids for o in graphed.generate(PROMPTS[:2], hot)] == ref
    assert "plain" in graphed.engine.runner.tree_steps and len(g.graphs) == n


@pytest.mark.parametrize("spec", [None, "tree:8"])
def test_graphs_across_context_buckets_equal_eager(pair, spec, monkeypatch):
    """Context buckets of 16 and 32 tokens, which the prompts' contexts cross while decoding: each step replays its
    bucket's graph (their attention's split counts differ), overlapped successors are carried from one bucket's
    graph into the next's, and the output equals the eager reference's."""
    import eyas.engine.cuda_graph as cg
    monkeypatch.setattr(cg, "CONTEXT_BUCKETS", (16, 32))
    ref, graphed = eager_reference_and_graphed(*pair, spec)
    runner = graphed.engine.runner
    handles, launch = [], runner.launch
    runner.launch = lambda seqs, after=None: (handles.append((after, launch(seqs, after))), handles[-1][1])[1]
    assert [graphed.generate([p], PARAMS)[0].token_ids for p in PROMPTS] == ref
    assert [o.token_ids for o in graphed.generate(PROMPTS, PARAMS)] == ref
    full = runner.graphs.context_buckets[-1]
    assert {k[3] for k in runner.graphs.graphs} == {16, 32, full}
    crossed = [a.graph_key[3] != h.graph_key[3] for a, h in handles if a is not None]
    assert any(crossed)  # a carried step went on in the next bucket's graph


@pytest.mark.parametrize("spec", [None, "chain:4", "dispatch:1=tree:mc_sim_7b_63,2=tree:8,8=plain", "dyn:k3d4n8"])
def test_overlapped_graphs_equal_sequential_graphs(pair, spec):
    """Overlapped decoding on graphs (each successor's inputs carried by the captured carry graph) equals graphed
    decoding that reads every step back first: greedy and sampled requests, each with its own token limit, more
    requests than run at once (the graphs' other tests run with overlap on, against the eager path). With a
    dispatcher, greedy requests only."""
    target, draft = pair
    kw = dict(device="cuda", dtype="float32", draft=str(draft) if spec else None, speculation=spec,
              cuda_graphs=True, max_num_seqs=3)
    prompts = (PROMPTS * 2)[:6]
    params = [SamplingParams(temperature=[0.0, 0.8][i % 2], max_tokens=10 + 7 * i, seed=i, ignore_eos=True)
              for i in range(6)]
    ref = LLM(str(target), overlap=False, **kw).generate(prompts, params)
    llm = LLM(str(target), overlap=True, **kw)
    carried = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda seqs, after=None: (carried.append(after is not None), launch(seqs, after))[1]
    got = llm.generate(prompts, params)
    if spec is not None and spec.startswith("dispatch:"):
        # a successor keeps a finished request's row one step longer, so the batch sizes and with them a
        # dispatcher's trees differ from sequential decoding's: only the greedy requests' tokens (tree-independent)
        # compare (session 20's GPU call found index 5, sampled, apart; tests/test_overlap.py's `_same` as well)
        assert [o.token_ids for o in got][::2] == [o.token_ids for o in ref][::2]
    else:
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(carried) > len(carried) / 3
    assert llm.engine.blocks.num_used == 0


@pytest.mark.parametrize("spec", [None, "chain:4", "tree:mc_sim_7b_63", "dyn:k3d4n8"])
def test_prefix_cache_hits_on_graphs_equal_eager_without_it(pair, spec):
    """Prompts that share a system prefix, then second turns (prompt + answer + more), on graphs with overlapped
    decoding and prefix caching (block size 4: many hits, some on blocks that decode steps filled), equal the
    eager reference path without prefix caching."""
    target, draft = pair
    kw = dict(device="cuda", dtype="float32", draft=str(draft) if spec else None, speculation=spec, block_size=4)
    system = list(range(1, 15))
    first = [system + [20, 21, 22], system + [23] * 6, system + [5, 9, 13, 2, 7, 11, 3, 19, 17]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(llm):
        outs = llm.generate(first, params)
        turn2 = [p + o.token_ids + [4, 8, 12, 16, 20] for p, o in zip(first, outs)]
        return outs + llm.generate(turn2 + [system + [1, 2, 3, 4]], params)

    eager = LLM(str(target), prefix_caching=False, **kw)
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    ref = [o.token_ids for o in run(eager)]
    graphed = LLM(str(target), cuda_graphs=True, overlap=True, **kw)
    got = run(graphed)
    assert [o.token_ids for o in got] == ref
    assert all(o.num_cached_tokens >= 12 for o in got[3:]) and graphed.engine.blocks.num_used == 0


def same_logprobs(got, ref):
    """Each token's log-probability and its top k (ids and values) agree; the ids of tokens a grammar forbids
    (log-probability -inf, tied) may differ."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.logprob == pytest.approx(r.logprob, abs=1e-4)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in r.top], abs=1e-4)
        assert [t for t, v in g.top if v > -math.inf] == [t for t, v in r.top if v > -math.inf]


@pytest.mark.parametrize("spec", [None, "chain:4", "tree:mc_sim_7b_63", "dyn:k3d4n8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_and_penalties_on_graphs_equal_eager(pair, spec, temperature):
    """Requests that ask for log-probabilities (k of 0, 2, 3 and 5) or penalties (allowed_token_ids among them: rows
    of -inf; bad words of one and several tokens, taken from the free outputs), batched with free ones and alone,
    replay graphs of their own kind (`launch_extras`) in an engine with graphs and overlap on, most of their steps
    overlapped (carried inputs; the counts and log-probabilities of the step before read on the device): tokens and
    log-probabilities equal the eager step's (greedy: the reference path; sampled, seeded: the eager Triton path,
    whose kernels the graphs replay, acceptance counts included)."""
    target, draft = pair
    kw = dict(device="cuda", dtype="float32", draft=str(draft) if spec else None, speculation=spec)
    base = dict(max_tokens=30, ignore_eos=True, temperature=temperature)
    params = [SamplingParams(logprobs=2, seed=1, **base), SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4,
                                                                         logit_bias={5: 3.0}, seed=2, **base),
              SamplingParams(seed=3, **base),
              SamplingParams(logprobs=5, presence_penalty=0.7, min_tokens=12, stop_token_ids=[5, 9], seed=4, **base)]
    mixed = [SamplingParams(logprobs=0, seed=5, **base), SamplingParams(seed=6, **base)]
    mixed.append(SamplingParams(logit_bias={3: 4.0, 11: -5.0, 17: 2.5}, seed=8, **base))  # a bias alone
    mixed.append(SamplingParams(allowed_token_ids=[2, 3, 7, 11, 19], logprobs=3, seed=9, **base))  # -inf rows
    eager = LLM(str(target), **kw)
    if temperature == 0:
        eager.engine.runner.use_triton = False
        reference_ops(eager)
    same = (lambda o: o.token_ids) if temperature == 0 else (lambda o: (o.token_ids, o.stats.accepted_by_depth))
    free = eager.generate(PROMPTS, SamplingParams(seed=11, **base))
    worded = [SamplingParams(bad_words_token_ids=[o.token_ids[3:5], o.token_ids[7:10], o.token_ids[12:13]],
                             seed=11, **base) for o in free[:3]]
    worded.append(SamplingParams(logprobs=2, seed=12, **base))  # no words, in their steps
    ref = eager.generate(PROMPTS, params) + eager.generate(PROMPTS, mixed) + eager.generate(PROMPTS, worded)
    alone = [(p, sp) for p, sp in zip(PROMPTS, params)][:2]
    ref += [eager.generate([p], sp)[0] for p, sp in alone]
    graphed = LLM(str(target), cuda_graphs=True, overlap=True, **kw)
    runner, carried = graphed.engine.runner, []
    launch = runner.launch

    def counted(seqs, after=None):  # overlapped steps (their successor replays while they are read back)
        carried.append(after is not None)
        return launch(seqs, after)
    runner.launch = counted
    got = graphed.generate(PROMPTS, params) + graphed.generate(PROMPTS, mixed) + graphed.generate(PROMPTS, worded)
    got += [graphed.generate([p], sp)[0] for p, sp in alone]
    del runner.launch
    assert sum(carried) > len(carried) / 3, "extras steps were not overlapped"
    for o, r in zip(got, ref, strict=True):
        assert same(o) == same(r)
        assert (o.logprobs is None) == (r.logprobs is None)
        if r.logprobs is not None:
            same_logprobs(o.logprobs, r.logprobs)
    for o, sp in zip(got[8:11], worded):
        words = [tuple(w) for w in sp.bad_words_token_ids]
        assert not any(tuple(o.token_ids[i: i + len(w)]) == w for w in words for i in range(len(o.token_ids)))
    extras = graphed.engine.runner.graphs.extras
    assert {k[4:] for k in extras} >= {(True, 1), (True, 0), (False, 1), (True, 2)}, "not every kind ran on graphs"
    assert {k[0] for k in extras} >= {1, 4}
    assert graphed.engine.blocks.num_used == 0


def test_smollm2_graphs_equal_eager():
    from eyas.loader.resolve import default_draft_path, smollm2_path
    try:
        smollm2_path()
    except ValueError as e:  # a GPU machine where the model was not staged
        pytest.skip(str(e))
    prompts = ["The capital of France is", "Write a haiku about GPUs.", "1, 2, 3, 4,", "def fibonacci(n):",
               "Once upon a time"]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    draft = "default" if default_draft_path("smollm2") else None
    spec = "chain:3" if draft else None
    eager = LLM("smollm2", device="cuda", dtype="float32", draft=draft, speculation=spec)
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    ref = [o.token_ids for o in eager.generate(prompts, params)]
    graphed = LLM("smollm2", device="cuda", dtype="float32", draft=draft, speculation=spec, cuda_graphs=True)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == ref
    if draft:  # the shipped draft's own GPU default: a dispatch (dyn:k4d3n8 for 5 requests, its fitted tree for one)
        auto = LLM("smollm2", device="cuda", dtype="float32", draft=draft, cuda_graphs=True)
        assert auto.engine.tree.name.startswith("dispatch:")
        assert [o.token_ids for o in auto.generate(prompts, params)] == ref
        assert auto.generate(prompts[1], params)[0].token_ids == ref[1]


@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_smollm2_quantized_draft_under_graphs_gives_the_targets_output(quant):
    """A quantized draft (`draft_quant="int4"`: PyTorch's CUDA int4 kernel inside the captured step; "fp8": the
    Triton GEMV's FP8 path) changes the guesses, not the output: graphed speculative decoding equals eager plain
    decoding on the reference ops."""
    from eyas.loader.resolve import default_draft_path, smollm2_path
    try:
        smollm2_path()
    except ValueError as e:
        pytest.skip(str(e))
    if not default_draft_path("smollm2"):
        pytest.skip("no shipped draft")
    prompts = ["The capital of France is", "Write a haiku about GPUs.", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    eager = LLM("smollm2", device="cuda", dtype="float32")
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    ref = [o.token_ids for o in eager.generate(prompts, params)]
    for spec in ("chain:3", "tree:smollm2_48d5"):
        llm = LLM("smollm2", device="cuda", dtype="float32", draft="default", speculation=spec, draft_quant=quant,
                  cuda_graphs=True)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == ref
        assert sum(o.stats.committed for o in outs) > 1.5 * sum(o.stats.target_calls for o in outs)


@pytest.fixture(scope="module")
def guided_mirror(tmp_path_factory):
    from helpers import write_guided_mirror
    return write_guided_mirror(tmp_path_factory.mktemp("guided"))


@pytest.mark.parametrize("spec", [None, "chain:3", "tree:8", "dyn:k4d3n8"])
def test_guided_graphs_equal_eager(guided_mirror, spec):
    """Guided steps replayed as three graphs (draft; verify; masks from the host, acceptance, commit) equal the
    eager guided step: greedy against the reference path, sampled (seeded) against the eager Triton path (tokens and
    acceptance); guided requests batched with an unguided one; the guided graphs were replayed."""
    from eyas import GuidedDecoding
    target, draft, _ = guided_mirror
    guides = [GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), GuidedDecoding(json_object=True),
              GuidedDecoding(choice=["abc", "ba"]), GuidedDecoding(regex=r"[a-z ]{5,60}\."), None]
    prompts = ["Hello there", "yes or no?", "{\""]
    kw = dict(device="cuda", dtype="float32", draft=str(draft) if spec else None, speculation=spec)
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=40, guided=g, temperature=temperature, seed=i)
                  for i, g in enumerate(guides)]
        eager = LLM(str(target), **kw)
        if temperature == 0:
            eager.engine.runner.use_triton = False
            reference_ops(eager)
        graphed = LLM(str(target), cuda_graphs=True, **kw)
        for p in prompts:
            # sampled, the eager Triton path runs the graphs' kernels: the draft's proposals (its root's children
            # among the tokens the grammar allows) and so the acceptance are the same too
            same = (lambda o: (o.token_ids, o.finish_reason)) if temperature == 0 else \
                (lambda o: (o.token_ids, o.finish_reason, o.stats.accepted_by_depth))
            # and a grammar that starts after a token (a reasoning model's </think>): the free output's third
            gate = (eager.generate([p], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids + [0] * 3)[2]
            gated = SamplingParams(max_tokens=40, guided=GuidedDecoding(json_object=True, after_token_id=gate),
                                   temperature=temperature, seed=9)
            ref = [same(o) for o in eager.generate([p] * (len(guides) + 1), params + [gated])]
            got = [same(o) for o in graphed.generate([p] * (len(guides) + 1), params + [gated])]
            assert got == ref, (spec, temperature, p)
            assert graphed.generate([p], params[1])[0].token_ids == ref[1][0]  # bucket 1, alone
        assert graphed.engine.runner.graphs.guided, "no guided step ran on graphs"
        assert graphed.engine.blocks.num_used == 0


@pytest.mark.parametrize("spec", ["chain:3", "dyn:k4d3n8"])
def test_guided_graphs_with_logprobs_and_penalties_equal_eager(guided_mirror, spec):
    """Guided requests that also ask for log-probabilities and penalties: the accept graph masks, then penalises,
    then reports them; greedy tokens and log-probabilities equal the eager reference path's."""
    from eyas import GuidedDecoding
    target, draft, _ = guided_mirror
    from test_guided import TAG
    guides = [GuidedDecoding(regex=r"[a-z ]{5,60}\."), GuidedDecoding(json_object=True), None,
              GuidedDecoding(structural_tag=TAG)]
    params = [SamplingParams(max_tokens=40, guided=g, logprobs=3, repetition_penalty=1.3, presence_penalty=0.5)
              for g in guides]
    kw = dict(device="cuda", dtype="float32", draft=str(draft), speculation=spec)
    eager = LLM(str(target), **kw)
    eager.engine.runner.use_triton = False
    reference_ops(eager)
    graphed = LLM(str(target), cuda_graphs=True, **kw)
    for p in ["Hello there", "{\""]:
        ref = eager.generate([p] * len(guides), params)
        got = graphed.generate([p] * len(guides), params)
        for o, r in zip(got, ref, strict=True):
            assert (o.token_ids, o.finish_reason) == (r.token_ids, r.finish_reason)
            same_logprobs(o.logprobs, r.logprobs)
    assert any(k[4:] == (True, True) for k in graphed.engine.runner.graphs.guided)


def test_graphs_captured_beside_a_prefill_thread(guided_mirror):
    """`disaggregate="cuda:0,cuda:0"`: the decode engine captures its graphs (guided ones among them) when its steps
    first need them, while the prefill engine's thread works on the same GPU (its synchronisations invalidated a
    capture in CUDA's global capture mode: session 50); outputs equal one graphed engine's."""
    from eyas import GuidedDecoding
    target, draft, _ = guided_mirror
    guides = [GuidedDecoding(regex=r"(yes|no), [0-9]{1,3}!"), GuidedDecoding(json_object=True),
              GuidedDecoding(regex=r"[a-z ]{5,60}\."), None]
    prompts = [p for p in ["Hello there", "yes or no?", "{\"", "abcabc abcabc", "a", "b"] for _ in guides]
    params = [SamplingParams(max_tokens=40, guided=g) for g in guides] * 6
    kw = dict(dtype="float32", draft=str(draft), speculation="tree:8", cuda_graphs=True)
    ref = [(o.token_ids, o.finish_reason) for o in LLM(str(target), device="cuda", **kw).generate(prompts, params)]
    dis = LLM(str(target), disaggregate="cuda:0,cuda:0", **kw)
    try:
        got = [(o.token_ids, o.finish_reason) for o in dis.generate(prompts, params)]
        assert dis.engine.decode.runner.graphs.guided
    finally:
        dis.engine.close()
    assert got == ref
