"""`eyas make-context-prompts`: task templates filled with passages from conversation files."""
import json

import pytest

from eyas.train.context_prompts import make_context_prompts, read_templates
from eyas.train.data import read_jsonl


def _data(tmp_path):
    recs = []
    for i in range(12):
        words = " ".join(f"w{i}_{j}" for j in range(5 + 5 * i))  # 5, 10, ..., 60 words
        recs.append({"id": f"r{i}", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": words}]})
    recs.append({"id": "dup", "conversations": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": recs[3]["conversations"][1]["value"]}]})
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def _templates(tmp_path, lines):
    p = tmp_path / "t.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_prompts_fill_templates_with_distinct_passages(tmp_path):
    data = _data(tmp_path)
    tpl = read_templates(_templates(tmp_path, ["# a comment", "", "Sum up:\\n\\n{text}", "{text}\\nWhat is it?"]))
    assert tpl == ["Sum up:\n\n{text}", "{text}\nWhat is it?"]
    out = tmp_path / "p.jsonl"
    info = make_context_prompts([data], tpl, 6, str(out), seed=1, min_words=10, max_words=40, progress=False)
    recs = list(read_jsonl(out))
    assert info["passages"] == 7 and len(recs) == 6  # 10..40 words: r1..r7 (the duplicate of r3 counted once)
    used = []
    for i, r in enumerate(recs):
        assert r["template"] == i % 2
        text = r["conversations"][0]["content"]
        pre, post = tpl[i % 2].split("{text}")
        assert text.startswith(pre) and text.endswith(post)
        passage = text[len(pre): len(text) - len(post)]
        assert 10 <= len(passage.split()) <= 40 and passage.startswith(f"w{r['passage_of'][1:]}_0")
        used.append(passage)
    assert len(set(used)) == 6
    again = tmp_path / "q.jsonl"
    make_context_prompts([data], tpl, 6, str(again), seed=1, min_words=10, max_words=40, progress=False)
    assert again.read_text() == out.read_text()
    other = tmp_path / "o.jsonl"
    make_context_prompts([data], tpl, 6, str(other), seed=2, min_words=10, max_words=40, progress=False)
    assert other.read_text() != out.read_text()


def test_bad_input_is_refused(tmp_path):
    data = _data(tmp_path)
    with pytest.raises(ValueError, match="exactly once"):
        read_templates(_templates(tmp_path, ["no placeholder"]))
    with pytest.raises(ValueError, match="no such file"):
        read_templates(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no templates"):
        read_templates(_templates(tmp_path, ["# only a comment"]))
    with pytest.raises(ValueError, match="usable passages"):
        make_context_prompts([data], ["{text}"], 8, str(tmp_path / "x.jsonl"), min_words=10, max_words=40,
                             progress=False)
    with pytest.raises(ValueError, match="min-words"):
        make_context_prompts([data], ["{text}"], 1, str(tmp_path / "x.jsonl"), min_words=50, max_words=40,
                             progress=False)
