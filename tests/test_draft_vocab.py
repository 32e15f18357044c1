"""A reduced draft vocabulary (`eyas.spec.draft_vocab`): the selection, the top-k over the subset against a masked
full-vocabulary oracle, exactness through the engine (the whole vocabulary as a subset changes nothing; a small one
stays exact), the checkpoint file and `eyas make-draft-vocab`. The sampled law with a subset is checked in
tests/test_spec_distribution.py."""
import gzip
import json
import shutil

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.spec.draft_vocab import (FILE, attach_draft_vocab, draft_topk, load_draft_vocab, save_draft_vocab,
                                   select_draft_vocab)
from helpers import load_mirror_pair, write_mirror_pair, write_tiny_llama


def test_select_draft_vocab():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert select_draft_vocab(counts, 3).tolist() == [2, 3, 5]  # the 3 most frequent, sorted
    assert select_draft_vocab(counts, 2).tolist() == [2, 3]  # a tie goes to the lower id
    assert select_draft_vocab(counts, 2, always=[1]).tolist() == [1, 2, 3]  # EOS kept even if never seen
    assert select_draft_vocab(counts, 6).tolist() == list(range(6))
    for bad in (0, 7):
        with pytest.raises(ValueError, match="between 1 and the vocabulary"):
            select_draft_vocab(counts, bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        select_draft_vocab(counts, 2, always=[6])


@pytest.fixture(scope="module")
def mirror_pair(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror_vocab"), vocab=24, layers=2)


def test_draft_topk_equals_the_masked_full_vocabulary(mirror_pair):
    target, draft = load_mirror_pair(mirror_pair)
    h = torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full = draft_topk(draft, target, h, 4)
    torch.testing.assert_close(full, target.compute_logits(h).topk(4, dim=-1).indices)
    assert torch.equal(draft_topk(draft, target, h, 1), target.compute_logits(h).topk(1, dim=-1).indices)
    ids = torch.tensor([1, 4, 5, 8, 11, 13, 20, 23])
    attach_draft_vocab(draft, target, ids)
    got = draft_topk(draft, target, h, 4)
    masked = target.compute_logits(h).masked_fill(~torch.isin(torch.arange(24), ids), float("-inf"))
    assert torch.equal(got, masked.topk(4, dim=-1).indices)
    assert torch.equal(draft_topk(draft, target, h, 1), masked.topk(1, dim=-1).indices)
    assert torch.isin(got, ids).all()
    attach_draft_vocab(draft, target, None)
    assert torch.equal(draft_topk(draft, target, h, 4), full)
    for bad in (torch.tensor([], dtype=torch.long), torch.tensor([3, 24]), torch.tensor([2, 2])):
        with pytest.raises(ValueError, match="draft vocabulary ids"):
            attach_draft_vocab(draft, target, bad)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 24, (n,), generator=g).tolist() for n in (1, 9, 16)]


def test_engine_stays_exact_with_a_draft_vocabulary(mirror_pair, tmp_path):
    target, draft = mirror_pair
    spec = "tree:8"
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(_prompts(), params)]
    base = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec).generate(_prompts(), params)
    # the whole vocabulary as the subset: the same proposals, so the same outputs and the same target calls
    whole = tmp_path / "whole"
    shutil.copytree(draft, whole)
    save_draft_vocab(whole, torch.arange(24))
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(whole), speculation=spec)
    assert llm.draft.vocab_ids.tolist() == list(range(24))
    outs = llm.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base] == ref
    assert [o.stats.target_calls for o in outs] == [o.stats.target_calls for o in base]
    # a subset without the most used tokens: still exact, and fewer draft tokens are accepted
    used = torch.bincount(torch.tensor([t for r in ref for t in r]), minlength=24)
    small = tmp_path / "small"
    shutil.copytree(draft, small)
    save_draft_vocab(small, torch.argsort(used)[:12].sort().values)  # the 12 least used tokens
    outs = LLM(str(target), device="cpu", dtype="float32", draft=str(small), speculation=spec).generate(
        _prompts(), params)
    assert [o.token_ids for o in outs] == ref
    accepted = lambda os: sum(sum(o.stats.accepted_by_depth) for o in os)  # noqa: E731
    assert accepted(outs) < accepted(base)


def test_make_draft_vocab_writes_the_file(tmp_path, capsys):
    from eyas.cli import main
    target = write_tiny_llama(tmp_path / "t", vocab=30, hidden=32, heads=4, kv_heads=2, layers=1)
    cfg = json.loads((target / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    data = tmp_path / "d.jsonl.gz"
    with gzip.open(data, "wt") as f:
        for r in range(20):
            ids = [3, 4, 5] + [7, 7, 8, 9, (r % 4) + 10]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0, 0, 0] + [1] * 5}) + "\n")
    out = tmp_path / "draft"
    out.mkdir()
    assert main(["make-draft-vocab", "--model", str(target), "--data", str(data), "--size", "4", "--out",
                 str(out)]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = load_draft_vocab(out)
    expect = {7, 8, 9, 10} | ({eos} if isinstance(eos, int) else set(eos or []))
    assert set(ids.tolist()) == expect and ids.tolist() == sorted(ids.tolist())
    assert rep["coverage"] == pytest.approx((20 * 4 + 5) / 100)  # 7,7,8,9 each row + the five 10s
    assert (out / FILE).exists()
    with pytest.raises(SystemExit, match="--size must be >= 1"):
        main(["make-draft-vocab", "--model", str(target), "--data", str(data), "--size", "0", "--out", str(out)])
    with pytest.raises(SystemExit, match="not a directory"):
        main(["make-draft-vocab", "--model", str(target), "--data", str(data), "--size", "4", "--out",
              str(tmp_path / "nope")])
