"""`eyas average-drafts` (eyas/train/average.py): the weighted mean of drafts, and what it refuses."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.cli import main as cli_main
from eyas.loader.eagle import load_draft
from eyas.loader.resolve import load_target
from eyas.train.average import average_drafts
from helpers import write_random_draft, write_tiny_llama


@pytest.fixture()
def pair(tmp_path):
    target = write_tiny_llama(tmp_path / "t", vocab=40, hidden=32, layers=2)
    a = write_random_draft(tmp_path / "a", target, seed=1)
    b = write_random_draft(tmp_path / "b", target, seed=2)
    return target, a, b


def test_weighted_mean_of_every_tensor(tmp_path, pair):
    target, a, b = pair
    # serving choices may differ (they say how a draft runs, not what it is); the first draft's are kept
    cfg = json.loads((a / "config.json").read_text())
    (a / "config.json").write_text(json.dumps({**cfg, "eyas_speculation": {"cpu": "chain:2"}}))
    info = average_drafts([str(a), str(b)], str(tmp_path / "m"), weights=[1.0, 3.0])
    assert info["weights"] == [0.25, 0.75]
    sa, sb, sm = (load_file(str(p / "model.safetensors")) for p in (a, b, tmp_path / "m"))
    assert sm.keys() == sa.keys() and len(sm) > 3
    for k in sa:
        torch.testing.assert_close(sm[k], 0.25 * sa[k] + 0.75 * sb[k], rtol=1e-6, atol=1e-7)
        assert not torch.equal(sm[k], sa[k]) or torch.equal(sa[k], sb[k])
    assert json.loads((tmp_path / "m" / "config.json").read_text())["eyas_speculation"] == {"cpu": "chain:2"}
    assert [s["path"] for s in json.loads((tmp_path / "m" / "training.json").read_text())["average_of"]] == \
        [str(a), str(b)]
    # the mean is a draft the engine loads
    tgt, _ = load_target(str(target), "cpu", torch.float32)
    load_draft(tmp_path / "m", tgt)


def test_equal_weights_by_default_and_dtype_kept(tmp_path, pair):
    _, a, b = pair
    for p in (a, b):  # stored in bf16, as the trainer saves them
        sd = load_file(str(p / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(p / "model.safetensors"))
    average_drafts([str(a), str(b)], str(tmp_path / "m"))
    sa, sb, sm = (load_file(str(p / "model.safetensors")) for p in (a, b, tmp_path / "m"))
    for k in sa:
        assert sm[k].dtype == torch.bfloat16
        assert torch.equal(sm[k], ((sa[k].float() + sb[k].float()) / 2).to(torch.bfloat16))


def test_refuses_what_cannot_be_averaged(tmp_path, pair):
    target, a, b = pair
    with pytest.raises(ValueError, match="at least two"):
        average_drafts([str(a)], str(tmp_path / "m"))
    with pytest.raises(ValueError, match="2 weights for 3 drafts"):
        average_drafts([str(a), str(b), str(a)], str(tmp_path / "m"), weights=[1, 1])
    with pytest.raises(ValueError, match="weights must be >= 0"):
        average_drafts([str(a), str(b)], str(tmp_path / "m"), weights=[1, -1])
    with pytest.raises(ValueError, match="one of the drafts"):
        average_drafts([str(a), str(b)], str(b))
    two = write_random_draft(tmp_path / "two", target, layers=2, seed=3)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        average_drafts([str(a), str(two)], str(tmp_path / "m"))
    with pytest.raises(ValueError, match="expected config.json"):
        average_drafts([str(a), str(tmp_path)], str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()  # nothing written by a refused call


def test_cli_errors_exit_2(tmp_path, pair, capsys):
    _, a, _ = pair
    assert cli_main(["average-drafts", str(a), "--out", str(tmp_path / "m")]) == 2
    assert "at least two drafts" in capsys.readouterr().err
