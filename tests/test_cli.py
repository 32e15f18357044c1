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
    assert main(["generate", "--model", "smollm2", "--prompt", "hi", "--device", "cpu", "--dtype", "float32",
                 "--draft", "none", "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err


def test_generate_takes_the_penalties(tmp_path, capsys):
    """--repetition-penalty / --frequency-penalty / --presence-penalty reach the engine: the text is the API's with
    the same penalties, and not the text without them."""
    from eyas import LLM
    path = _tiny_with_tokenizer(tmp_path)
    args = ["generate", "--model", str(path), "--prompt", "w1 w2 w3", "--max-tokens", "16", "--device", "cpu",
            "--dtype", "float32", "--draft", "none", "--ignore-eos"]
    pen = dict(repetition_penalty=1.6, frequency_penalty=0.5, presence_penalty=0.25)
    assert main(args + ["--repetition-penalty", "1.6", "--frequency-penalty", "0.5", "--presence-penalty",
                        "0.25"]) == 0
    out = capsys.readouterr().out.strip()
    llm = LLM(str(path), device="cpu", dtype="float32")
    ref = llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=16, ignore_eos=True, **pen))[0].text
    free = llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    assert out == ref.strip() and ref != free


def _tiny_with_tokenizer(tmp_path):
    """A tiny random Llama whose directory also holds a word-level tokenizer.json (words w0..w39)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from helpers import write_tiny_llama
    path = write_tiny_llama(tmp_path / "m", vocab=40, hidden=32, heads=4, kv_heads=2, layers=2)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    return path


def test_generate_tensor_parallel_2_equals_1(tmp_path, capfd, monkeypatch):
    """`eyas generate --tensor-parallel 2` (two gloo ranks on the CPU) prints what the single-process run prints."""
    path = _tiny_with_tokenizer(tmp_path)
    common = ["generate", "--model", str(path), "--prompt", "w3 w5 w7 w11", "--max-tokens", "16", "--device", "cpu",
              "--dtype", "float32", "--draft", "none", "--ignore-eos"]
    assert main(common) == 0
    single = capfd.readouterr().out.strip()
    assert main(common + ["--tensor-parallel", "2"]) == 0
    out, err = capfd.readouterr()
    assert out.strip() == single and len(single.split()) == 16
    assert "TP 2" in err
    # started by torchrun: each of its processes is one rank (no spawn of its own); rank 0 prints
    import os
    import subprocess
    import sys
    from eyas.dist.launch import free_port
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), "-m", "eyas.cli", *common, "--tensor-parallel", "2"],
                       capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == single and r.stderr.count("TP 2") == 1
    # a rank of a torchrun of 2 processes (its environment) asked for 3 ranks: an error before any process group
    capfd.readouterr()
    with monkeypatch.context() as m:
        for k, v in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            m.setenv(k, v)
        assert main(common + ["--tensor-parallel", "3"]) != 0
    assert "torchrun started 2 processes" in capfd.readouterr().err


def test_commands_without_the_servers_dependencies():
    """Where fastapi is missing (a GPU machine with torch alone), `eyas serve` and `eyas run-batch` are left out and
    every other command still parses; before, run-batch's parser imported the server and took the whole CLI down."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['fastapi'] = None\n"  # `import fastapi` now raises ImportError
            "from eyas.cli import build_parser\n"
            "p = build_parser()\n"
            "names = set(p._subparsers._group_actions[0].choices)\n"
            "assert {'generate', 'bench', 'train-draft'} <= names and not names & {'serve', 'run-batch'}, names\n"
            "a = p.parse_args(['bench', 'latency', '--temperature', '1'])\n"
            "assert a.temperature == 1.0\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
