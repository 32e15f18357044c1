"""`eyas make-tree`: trees fitted to a draft from the ranks of the target's tokens among its proposals."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.loader.eagle import load_draft
from eyas.loader.resolve import load_target
from eyas.spec.tree import resolve_tree
from eyas.spec.tree_builder import (MISS, best_tree, expected_tpc, main, prefix_counts, rank_paths, refit,
                                    replay, replayed_tpc)
from eyas.train.data import Example

from helpers import write_mirror_pair


def _random_paths(n, depth, max_rank, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, max_rank, (n, depth), generator=g)
    # skewed towards rank 0, with misses that cut the path
    p = torch.where(torch.rand(n, depth, generator=g) < 0.5, torch.zeros_like(p), p)
    p = torch.where(torch.rand(n, depth, generator=g) < 0.15, torch.full_like(p, MISS), p)
    return torch.where((p == MISS).cumsum(-1) > 0, torch.full_like(p, MISS), p)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_tree_is_the_best_by_enumeration(seed):
    """Among all ancestor-closed sets of N rank paths (depth <= 3, ranks < 3), none accepts more on these paths."""
    paths = _random_paths(60, 3, 3, seed)
    universe = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    c = prefix_counts(paths)
    for n in (1, 3, 4):
        tree = best_tree(paths, n)
        assert len(tree) == n and all(tuple(p[:-1]) in {tuple(q) for q in tree} | {()} for p in tree)  # closed
        best = max(sum(c.get(p, 0) for p in sub) for sub in itertools.combinations(universe, n)
                   if all(p[:-1] == () or p[:-1] in sub for p in sub))
        assert sum(c.get(tuple(p), 0) for p in tree) == best
        assert expected_tpc(paths, tree) == pytest.approx(1 + best / len(paths))
    assert all(len(p) <= 2 for p in best_tree(paths, 8, max_depth=2))


@pytest.fixture(scope="module")
def pair_and_text(tmp_path_factory):
    """The mirror pair with noise on its draft's layer weights (its proposals are then often, not always, the
    target's: ranks 0 to 3 all occur) and a greedy text of the target: prompt + 60 tokens."""
    from safetensors.torch import load_file, save_file
    tdir, ddir = write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)
    w = load_file(str(ddir / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for k, v in w.items():
        if k.startswith("layers.") and v.dim() == 2:
            w[k] = v + 0.3 * torch.randn(v.shape, generator=g) / v.shape[1] ** 0.5
    save_file(w, str(ddir / "model.safetensors"))
    prompt = [3, 7, 1, 12, 5]
    out = LLM(str(tdir), device="cpu", dtype="float32").generate(
        prompt, SamplingParams(max_tokens=60, ignore_eos=True))[0].token_ids
    return tdir, ddir, prompt, out


@pytest.mark.parametrize("spec", ["chain:3", "tree:16", "fitted"])
def test_rank_paths_predict_the_engines_steps_exactly(pair_and_text, tmp_path, spec):
    """On the target's own greedy text, replaying the steps over the rank paths gives the engine's target calls and
    committed tokens exactly (float32, the draft computes the same on the accepted path as along the true tokens)."""
    tdir, ddir, prompt, out = pair_and_text
    target, _ = load_target(str(tdir), "cpu", "float32")
    draft = load_draft(str(ddir), target)
    ids = prompt + out
    ex = Example(np.asarray(ids, dtype=np.int32), np.asarray([False] * len(prompt) + [True] * len(out)))
    depth, max_rank = 6, 4
    paths = rank_paths(target, draft, [ex], depth, max_rank)
    assert len(paths) == len(out)  # roots P - 2 .. len(ids) - 3: one per answer token
    assert rank_paths(target, draft, [ex], depth, max_rank, per_example=True)[0].equal(paths)
    top1 = (paths[:, 0] == 0).float().mean()
    assert 0.3 < top1 < 0.95 and (paths[:, 0] > 0).sum() >= 3, paths[:, 0]  # a draft that is often, not always, right
    if spec == "fitted":  # refit on the roots decoding visits: its replayed TPC is the engine's too
        tree, tpc = refit([paths], [40], 12, max_depth=5, min_count=1)
        assert tpc == replayed_tpc([paths], [40], tree) >= replayed_tpc([paths], [40], best_tree(paths, 12, 5))
        f = tmp_path / "tree.json"
        f.write_text(json.dumps(tree))
        spec = str(f)
    else:
        tree = [list(p) for p in resolve_tree(spec).paths]
    for M in (40, 60):  # 60: the answer's end cuts the last roots' paths, as max_tokens cuts the engine's steps
        res = LLM(str(tdir), device="cpu", dtype="float32", draft=str(ddir), speculation=spec).generate(
            prompt, SamplingParams(max_tokens=M, ignore_eos=True))[0]
        assert res.token_ids == out[:M]
        assert (res.stats.target_calls, res.stats.committed) == replay(paths, tree, M)


def test_make_tree_writes_trees_the_engine_takes(pair_and_text, tmp_path, capsys):
    tdir, ddir, prompt, out = pair_and_text
    data = tmp_path / "answers.jsonl"
    data.write_text(json.dumps({"input_ids": prompt + out, "loss_mask": [0] * len(prompt) + [1] * len(out)}) + "\n")
    assert main(["--model", str(tdir), "--draft", str(ddir), "--data", str(data), "--out", str(tmp_path / "t.json"),
                 "--nodes", "4", "12", "--max-depth", "5", "--max-rank", "4", "--min-count", "1",
                 "--compare", "chain:3", "--device", "cpu", "--dtype", "float32"]) == 0
    res = json.loads(capsys.readouterr().out)
    for n in (4, 12):
        info = res["trees"][str(n)]
        tree = resolve_tree(info["file"])
        assert tree.num_nodes == info["nodes"] == n and tree.max_depth <= 5
    assert all(res["trees"][n]["replayed_tpc_on_data"] > 1.0 for n in ("4", "12"))
    assert res["compare"]["chain:3"]["replayed_tpc_on_data"] > 1.0
    # replayed on other answers (here the same one): chain:3 as the engine measures it
    assert main(["--model", str(tdir), "--draft", str(ddir), "--data", str(data), "--out", str(tmp_path / "u.json"),
                 "--nodes", "6", "--max-rank", "4", "--min-count", "1", "--compare", "chain:3",
                 "--eval-data", str(data), "--save-eval-ranks", str(tmp_path / "ranks.safetensors"),
                 "--device", "cpu", "--dtype", "float32"]) == 0
    ev = json.loads(capsys.readouterr().out)["eval"]
    # the recording `bench latency --accept-ranks` replays: replaying chain:3 over it gives the engine's TPC too
    from eyas.bench.latency import load_ranks
    ranks = load_ranks(ev["ranks_file"])
    assert ranks.shape[1] == 8
    spec = LLM(str(tdir), device="cpu", dtype="float32", draft=str(ddir), speculation="chain:3").generate(
        prompt, SamplingParams(max_tokens=len(out), ignore_eos=True))[0].stats
    assert ev["replayed_tpc"]["chain:3"] == round(spec.committed / spec.target_calls, 4)
    assert replay(ranks, [[0], [0, 0], [0, 0, 0]], len(out)) == (spec.target_calls, spec.committed)
    assert ev["answer_tokens"] == len(out) and set(ev["replayed_tpc"]) == {"6", "chain:3"}
    with pytest.raises(ValueError, match=">= 1"):
        main(["--draft", str(ddir), "--data", str(data), "--out", str(tmp_path / "x.json"), "--nodes", "0"])


@pytest.mark.parametrize("name", ["smollm2_25", "smollm2_48d5", "smollm2_64", "smollm2_128"])
def test_fitted_presets_decode_exactly(pair_and_text, name):
    """The shipped fitted trees (up to 128 nodes, depth 8, ranks up to 9) through the engine: greedy speculative
    output equals plain decoding (here on the tiny pair: the tree's shape is what is under test)."""
    tdir, ddir, prompt, out = pair_and_text
    tree = resolve_tree(f"tree:{name}")
    nodes, _, depth = name.split("_")[1].partition("d")
    assert tree.num_nodes == int(nodes) and tree.max_depth <= int(depth or 8)
    res = LLM(str(tdir), device="cpu", dtype="float32", draft=str(ddir), speculation=f"tree:{name}").generate(
        prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert res.token_ids == out[:40] and res.stats.tokens_per_call > 1.5


def test_step_cost_fit_recovers_a_linear_cost_and_parses():
    from eyas.spec.tree_builder import StepCost
    true = StepCost(1.4, 0.09, 0.003, 0.05)
    modes = ["chain:3", "tree:8", "tree:16", "tree:mc_sim_7b_63", "tree:smollm2_25", "tree:smollm2_128"]
    rows = [{"mode": m, "batch": 1, "ms_per_decode_step": true.ms([list(p) for p in resolve_tree(m).paths])}
            for m in modes]
    rows += [{"mode": "plain", "batch": 1, "ms_per_decode_step": 9.0},  # skipped: not a tree
             {"mode": "chain:3", "batch": 4, "ms_per_decode_step": 9.0}]  # another batch size
    fit = StepCost.fit(rows)
    for a, b in zip((fit.base, fit.per_level, fit.per_node, fit.per_topk), (1.4, 0.09, 0.003, 0.05)):
        assert abs(a - b) < 1e-4
    assert StepCost.parse("1,0.1,0.01") == StepCost(1.0, 0.1, 0.01, 0.0)
    with pytest.raises(ValueError, match="BASE,PER_LEVEL"):
        StepCost.parse("1,2")
    with pytest.raises(ValueError, match=">= 4"):
        StepCost.fit(rows[:3])


def test_make_tree_picks_the_least_ms_per_token(pair_and_text, tmp_path, capsys):
    """With a step cost, every (size, depth limit) gets its predicted ms per token on the fit data, and OUT is the
    tree of the least."""
    from eyas.spec.tree_builder import StepCost
    tdir, ddir, prompt, out = pair_and_text
    data = tmp_path / "answers.jsonl"
    data.write_text(json.dumps({"input_ids": prompt + out, "loss_mask": [0] * len(prompt) + [1] * len(out)}) + "\n")
    cost = "1.0,0.5,0.02"  # levels dear: a shallow tree can win
    assert main(["--model", str(tdir), "--draft", str(ddir), "--data", str(data), "--out", str(tmp_path / "t.json"),
                 "--nodes", "3", "12", "--max-depth", "2", "6", "--max-rank", "4", "--min-count", "1",
                 "--step-cost", cost, "--compare", "chain:3", "--device", "cpu", "--dtype", "float32"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["trees"]) == {"3d2", "3d6", "12d2", "12d6"}
    sc = StepCost.parse(cost)
    per_token = {}
    for k, info in res["trees"].items():
        tree = json.loads(Path(info["file"]).read_text())
        assert max(len(p) for p in tree) <= int(k.split("d")[1])
        per_token[k] = sc.ms(tree) / info["replayed_tpc_on_data"]
        assert abs(per_token[k] - info["predicted_ms_per_token"]) < 1e-3
    best = min(per_token, key=per_token.get)
    assert res["best"]["tree"] == best
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(Path(res["trees"][best]["file"]).read_text())
    assert "predicted_ms_per_token" in res["compare"]["chain:3"]


@pytest.mark.parametrize("quant", [None, "int4-head"])
def test_rank_paths_of_a_draft_vocabulary_predict_the_engines_steps_exactly(pair_and_text, tmp_path, quant):
    """With a draft vocabulary (and its rows in INT4) the rank paths count only the tokens the draft can propose: a
    target token outside the vocabulary is a miss. Replayed, they still give the engine's steps exactly."""
    import shutil
    from collections import Counter

    from eyas.spec.draft_quant import quantize_draft
    from eyas.spec.draft_vocab import save_draft_vocab
    tdir, ddir, prompt, out = pair_and_text
    left_out = [t for t, _ in Counter(out).most_common()[1:3]]  # two tokens the target writes often
    vdir = tmp_path / "draft_vocab"
    shutil.copytree(ddir, vdir)
    save_draft_vocab(vdir, torch.tensor([t for t in range(24) if t not in left_out]))
    target, _ = load_target(str(tdir), "cpu", "float32")
    ids = prompt + out
    ex = Example(np.asarray(ids, dtype=np.int32), np.asarray([False] * len(prompt) + [True] * len(out)))
    draft = quantize_draft(load_draft(str(vdir), target), target, quant)  # as LLM(draft_quant=) does
    assert draft.vocab_ids is not None
    paths = rank_paths(target, draft, [ex], 6, 4)
    full = rank_paths(target, quantize_draft(load_draft(str(ddir), target), target, quant), [ex], 6, 4)
    misses = (paths[:, 0] == MISS).sum().item()
    assert misses >= (full[:, 0] == MISS).sum().item() + 2, (paths[:, 0], full[:, 0])  # the left-out tokens miss
    for spec in ("chain:3", "tree:16"):
        tree = [list(p) for p in resolve_tree(spec).paths]
        for M in (40, 60):
            res = LLM(str(tdir), device="cpu", dtype="float32", draft=str(vdir), speculation=spec,
                      draft_quant=quant).generate(prompt, SamplingParams(max_tokens=M, ignore_eos=True))[0]
            assert res.token_ids == out[:M]
            assert (res.stats.target_calls, res.stats.committed) == replay(paths, tree, M)
