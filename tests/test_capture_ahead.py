"""What `GraphedStep.capture_all` captures ahead of time, on the CPU with the captures stubbed (the graphs themselves
are held to eager steps on a GPU by tests/test_cuda_graph.py): with `extras` (`eyas serve --capture-extras`), every
step graph gets its log-probabilities / penalties twins, so that no such request pays a capture in its path."""
import pytest

from eyas import LLM
from eyas.engine.cuda_graph import GraphedStep
from helpers import write_mirror_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)


def stubbed(llm) -> GraphedStep:
    """A GraphedStep over `llm`'s runner whose captures record their keys instead of capturing."""
    g = GraphedStep(llm.engine.runner, llm.engine.max_model_len)
    g._capture_step = lambda static, mode, tree, logprobs=None, penalties=None: (None, None)
    g._capture_carry = lambda static, out: None
    return g


@pytest.mark.parametrize("extras", [((True, 0),), ((True, 0), (False, 1), (True, 1))])
def test_capture_all_captures_the_extras_twins_of_every_step_graph(pair, extras):
    target, draft = pair
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft),
              speculation="dispatch:1=chain:4,4=tree:8,64=plain|0.5=chain:2", max_num_seqs=8)
    g = stubbed(llm)
    plain = stubbed(llm).capture_all(8)
    n = g.capture_all(8, extras=extras)
    assert plain > 0 and len(g.graphs) == plain
    want = {k + e for k in g.graphs for e in extras}
    assert set(g.extras) == want and n == plain + len(want)
    assert {k[1] for k in g.extras} == {"greedy", "sampled", "filtered"} and len({k[2] for k in g.extras}) >= 3
    pens = {k[5] for k in g.extras if k[5]}
    assert set(g._extras_penalties) == {(k[0], p) for k in g.extras for p in pens}  # one buffer per batch bucket
    assert g.capture_all(8, extras=extras) == 0  # all there


def test_capture_all_advances_a_progress_bar_to_its_total(pair, monkeypatch):
    """`eyas serve`'s bar over the captures ahead: its total is what capture_all then captures (already captured
    graphs not counted), decode and prefill graphs on one bar, and it ends full."""
    import io
    from types import SimpleNamespace

    from tqdm import tqdm

    from eyas.engine import prefill_graph
    target, draft = pair
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft),
              speculation="dispatch:1=chain:4,4=tree:8,64=plain|0.5=chain:2", max_num_seqs=8)
    g = stubbed(llm)
    g.capture_all(2, modes=("greedy",))  # some there already
    done = []
    with tqdm(total=0, file=io.StringIO()) as bar:
        n = g.capture_all(8, extras=((True, 0),), progress=bar)
        told = bar.total
        runner = SimpleNamespace(draft=None, width=4, block_size=16, prefill_tokens=prefill_graph.GRAPH_TOKENS)
        pg = prefill_graph.PrefillGraphs(runner)
        pg._capture = lambda key: (done.append(key) or key)
        m = pg.capture_all(8, 512, bar)
        assert 0 < n == told and 0 < m == len(done) and bar.n == bar.total == n + m
        assert pg.capture_all(8, 512, bar) == 0 and bar.total == n + m
    capped = prefill_graph.PrefillGraphs(runner)  # at most MAX_GRAPHS prefill graphs, the bar told as many
    capped._capture = lambda key: key
    monkeypatch.setattr(prefill_graph, "MAX_GRAPHS", 3)
    with tqdm(total=0, file=io.StringIO()) as bar:
        assert capped.capture_all(8, 512, bar) == 3 == bar.total == bar.n and len(capped.graphs) == 3


def test_serve_flag_names_the_extras(pair):
    """`eyas serve --capture-extras logprobs penalties` hands capture_all those kinds' (log-probabilities,
    penalties) pairs; an unknown kind is refused by the parser."""
    import argparse
    from types import SimpleNamespace

    from eyas.serve.api_server import _capture_graphs, add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--capture-extras", "logprobs", "logprobs+penalties"])
    assert p.parse_args([]).capture_extras == []
    with pytest.raises(SystemExit):
        p.parse_args(["--capture-extras", "guided"])
    seen = []
    graphs = SimpleNamespace(capture_all=lambda n, extras=(), progress=None: seen.append((n, extras)) or 0)
    _capture_graphs(SimpleNamespace(runner=SimpleNamespace(graphs=graphs)), 8, args.capture_extras)
    assert seen == [(8, ((True, 0), (True, 1)))]


def test_no_collection_runs_while_a_capture_is_under_way(monkeypatch):
    """`capturing` keeps the cycle collector off through every capture under way (nested, as a disaggregated
    engine's two threads may capture at once), restores it after the last one ends, even when a capture fails, and
    leaves it off where it was off: a collection inside a capture would free a dropped engine's graphs, events and
    pinned buffers there (`torch.cuda.graph` is stubbed; tests/test_cuda_graph.py captures on a GPU)."""
    import contextlib
    import gc

    import torch

    import eyas.engine.cuda_graph as cg
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.append((graph, capture_error_mode, gc.isenabled()))
        yield
        seen.append((graph, "end", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    was = gc.isenabled()
    try:
        gc.enable()
        with cg.capturing("a", None):
            with cg.capturing("b", None):
                pass
            assert not gc.isenabled()  # b ended, a is still under way
        assert gc.isenabled()
        assert seen == [("a", "thread_local", False), ("b", "thread_local", False), ("b", "end", False),
                        ("a", "end", False)]
        with pytest.raises(RuntimeError):
            with cg.capturing("c", None):
                raise RuntimeError("capture invalidated")
        assert gc.isenabled()
        gc.disable()
        with cg.capturing("d", None):
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
