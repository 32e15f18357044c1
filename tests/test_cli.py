"""`eyas generate` streams the same text as the API and ends with a timings line; bad input exits 2 with a message."""
import re

import pytest

from eyas import SamplingParams
from eyas.cli import main


@pytest.mark.slow
def test_generate_streams_and_times(smollm2, capsys):
    rc = main(["generate", "--model", "smollm2", "--chat", "--prompt", "What is the capital of France?",
               "--max-tokens", "12", "--device", "cpu", "--dtype", "float32", "--draft", "none"])
    out, err = capsys.readouterr()
    assert rc == 0
    ref = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=12))[0]
    assert out.strip() == ref.text.strip()
    assert re.search(r"\[\d+ tokens \| TTFT [\d.]+ ms \| [\d.]+ tokens/s \| [\d.]+ ms/token\]", err), err


def test_bad_input_exits_2(capsys):
    assert main(["generate", "--model", "/no/such/model", "--prompt", "hi", "--device", "cpu"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["generate", "--model", "smollm2", "--prompt", "hi", "--device", "cpu", "--dtype", "float32",
                 "--draft", "none", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
