"""`eyas bench latency` on the CPU: it writes JSON, a markdown table and a plot for plain decoding, chains and the
tree dispatcher, and refuses bad input before loading anything."""
import json

import pytest

from eyas.bench.latency import split_modes, spread
from eyas.cli import main
from helpers import write_mirror_pair


def test_split_modes_keeps_a_dispatch_together():
    assert split_modes("plain,chain:3,dispatch:1=tree:8,16=plain,tree:16") == [
        "plain", "chain:3", "dispatch:1=tree:8,16=plain", "tree:16"]
    assert split_modes("dispatch:2=chain:4,8=plain") == ["dispatch:2=chain:4,8=plain"]


def test_spread_takes_one_prompt_per_category_of_mt_bench():
    assert spread(80, 8) == [0, 10, 20, 30, 40, 50, 60, 70]
    assert spread(3, 5) == [0, 1, 2, 0, 1] and spread(10, 1) == [0]
    for total, n in [(80, 7), (13, 5), (100, 33)]:
        idx = spread(total, n)
        assert len(set(idx)) == n and all(0 <= i < total for i in idx)


def test_bench_latency_writes_json_markdown_and_plot(tmp_path):
    target, draft = write_mirror_pair(tmp_path / "pair", vocab=24, layers=2)
    out = tmp_path / "lat"
    assert main(["bench", "latency", "--model", str(target), "--draft", str(draft), "--modes",
                 "plain,chain:4,dispatch:1=chain:4,2=plain", "--batch-sizes", "1,2", "--max-tokens", "12",
                 "--context", "5", "--num-prompts", "2", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads((out / "latency.json").read_text())
    rows = {(r["mode"], r["batch"]): r for r in res["results"]}
    assert set(rows) == {(m, b) for m in ("plain", "chain:4", "dispatch:1=chain:4,2=plain") for b in (1, 2)}
    assert not res["meta"]["simulated"]
    assert all(r["ttit_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows[("plain", 2)]["tpc"] == 1.0
    # batch 1 runs the 2 prompts one after the other; the timed steps only: 12 tokens, the first from prefill
    assert rows[("plain", 1)]["prompts"] == 2 and rows[("plain", 1)]["decode_steps"] == 22
    assert rows[("plain", 2)]["prompts"] == 2 and rows[("plain", 2)]["decode_steps"] == 11
    assert rows[("chain:4", 1)]["decode_steps"] < 22
    assert rows[("chain:4", 2)]["tpc"] > 1.5  # the mirror draft is accepted
    # the dispatcher runs chain:4 alone and plain steps at batch 2
    assert rows[("dispatch:1=chain:4,2=plain", 1)]["tpc"] > 1.5
    assert rows[("dispatch:1=chain:4,2=plain", 2)]["tpc"] == 1.0
    md = (out / "latency.md").read_text()
    assert "| chain:4 | 2 |" in md
    assert (out / "latency.png").stat().st_size > 1000


@pytest.mark.parametrize("bad", [["--modes", "tree:nope"], ["--modes", "dispatch:4=chain:3,2=plain"],
                                 ["--batch-sizes", "0"], ["--batch-sizes", "x"], ["--accept-rates", "high"],
                                 ["--num-prompts", "0"], ["--draft-vocab", "-1"]])
def test_bench_latency_refuses_bad_input(bad, tmp_path):
    with pytest.raises(SystemExit, match="eyas bench latency"):
        main(["bench", "latency", "--model", "no-such-model", "--out", str(tmp_path)] + bad)
