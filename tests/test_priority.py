"""vLLM's priority scheduling (`EngineConfig.scheduling_policy="priority"`, `SamplingParams.priority`; the policy is
in eyas.engine.scheduler): requests are admitted by (priority, arrival), a waiting request preempts running ones of
lower priority (the last in order first) when the batch is full or the pool short of blocks, and the decode step's
preemption takes the lowest priority. Every output still equals the request's output alone (greedy, plain and
speculative: preemption is recompute), and no block leaks."""
import pytest
import torch

from eyas import LLM, SamplingParams
from helpers import write_mirror_pair
from test_engine import VOCAB, tiny_dir  # noqa: F401 (the fixture)


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)


def _prompts(n, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3 + 4 * i,), generator=g).tolist() for i in range(n)]


def _alone(path, prompts, max_tokens, **kw):
    llm = LLM(str(path), device="cpu", dtype="float32", **kw)
    return [llm.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids for p in prompts]


def _run(llm, items, late=(), after=0):
    """Step `items` ((prompt, priority, max_tokens)) to the end; `late` ones are added after `after` steps. Returns
    the sequences (in the order given, late ones last) and their request ids in the order they finished."""
    eng = llm.engine
    seqs = [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True, priority=q)) for p, q, m in items]
    finished, steps = [], 0
    while eng.has_unfinished() or late:
        if steps == after and late:
            seqs += [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True, priority=q)) for p, q, m in late]
            late = ()
        finished += [o.request_id for o in eng.step() if o.finished]
        steps += 1
    assert eng.blocks.num_used == 0 and not eng.scheduler.waiting
    return seqs, finished


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_are_served_by_priority_then_arrival(tiny_dir, policy):
    """One place in the batch: under "priority" the requests finish by (priority, arrival), under "fcfs" by arrival
    (every priority 0 there, as that policy refuses others); the tokens are each request's alone."""
    prompts = _prompts(5, VOCAB)
    prio = [3, 0, 1, 0, 3] if policy == "priority" else [0] * 5
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", max_num_seqs=1, scheduling_policy=policy)
    seqs, finished = _run(llm, [(p, q, 8) for p, q in zip(prompts, prio)])
    order = [s.request_id for s in sorted(seqs, key=lambda s: (prio[seqs.index(s)], seqs.index(s)))]
    assert finished == order
    assert [s.output_ids for s in seqs] == _alone(tiny_dir, prompts, 8)
    if policy == "priority":
        assert finished != [s.request_id for s in seqs]


@pytest.mark.parametrize("spec", [None, "chain:4"])
def test_a_higher_priority_request_preempts_the_lowest(mirror, spec):
    """The batch is full (two places) with requests of priorities 5 and 9 when one of priority 0 arrives: the next
    step admits it in place of the priority-9 request (recomputed later), it finishes first, and a request of
    priority 9 that arrives too waits without preempting anyone; every output equals its alone."""
    target, draft = mirror
    kw = dict(draft=str(draft), speculation=spec) if spec else {}
    prompts = _prompts(4, 24, seed=2)
    llm = LLM(str(target), device="cpu", dtype="float32", max_num_seqs=2, scheduling_policy="priority", **kw)
    eng, sched = llm.engine, llm.engine.scheduler
    low5 = eng.add_request(prompts[0], SamplingParams(max_tokens=30, ignore_eos=True, priority=5))
    low9 = eng.add_request(prompts[1], SamplingParams(max_tokens=30, ignore_eos=True, priority=9))
    for _ in range(4):
        eng.step()
    assert not sched.can_admit()
    later9 = eng.add_request(prompts[3], SamplingParams(max_tokens=10, ignore_eos=True, priority=9))
    assert not sched.can_admit()  # equal priority preempts nobody
    high = eng.add_request(prompts[2], SamplingParams(max_tokens=10, ignore_eos=True, priority=0))
    assert sched.can_admit()  # so an overlapped engine enqueues no successor before admitting it
    finished = []
    while eng.has_unfinished():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished[0] == high.request_id and finished[-1] in (low9.request_id, later9.request_id)
    assert (high.num_preemptions, low5.num_preemptions, low9.num_preemptions, later9.num_preemptions) == (0, 0, 1, 0)
    alone = _alone(target, prompts, 30, **kw)
    assert [s.output_ids for s in (low5, low9, high, later9)] == [alone[0], alone[1], alone[2][:10], alone[3][:10]]
    assert eng.blocks.num_used == 0


def test_short_blocks_preempt_the_lowest_priority(tiny_dir):
    """A pool far too small for the batch (preemption at decode and at admission): the priority-0 request is never
    preempted, lower ones are, and every output equals its alone."""
    prompts = _prompts(8, VOCAB, seed=3)
    prio = [4, 2, 7, 0, 5, 1, 6, 3]
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", num_blocks=40, block_size=4,
              scheduling_policy="priority")
    seqs, finished = _run(llm, [(p, q, 40) for p, q in zip(prompts, prio)])
    assert llm.engine.scheduler.num_preemptions > 0
    assert seqs[prio.index(0)].num_preemptions == 0 and finished[0] == seqs[prio.index(0)].request_id
    assert [s.output_ids for s in seqs] == _alone(tiny_dir, prompts, 40)
    # two requests whose prompts fit but whose outputs do not: the decode step preempts the lower priority, though
    # it arrived first (by arrival, the later one would give way)
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", num_blocks=18, block_size=4, max_num_seqs=2,
              scheduling_policy="priority")
    (first, second), _ = _run(llm, [(prompts[0], 9, 40), (prompts[1], 0, 40)])
    assert first.num_preemptions > 0 and second.num_preemptions == 0
    assert [first.output_ids, second.output_ids] == _alone(tiny_dir, prompts[:2], 40)


def test_priority_is_refused_without_its_policy(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="priority 2 needs the priority scheduling policy"):
        llm.generate([[1, 2]], SamplingParams(priority=2))
    for bad in ("1", 1.5, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            SamplingParams(priority=bad)
    with pytest.raises(ValueError, match="scheduling policy must be one of"):
        LLM(str(tiny_dir), device="cpu", dtype="float32", scheduling_policy="lifo")
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, priority=0))[0].token_ids
