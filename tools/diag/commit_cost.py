"""The host's cost per step of committing tokens to a request, by output length: `LLMEngine._commit` (tokens in,
stop tokens and strings, incremental detokenisation, the `RequestOutput`), the server loop's accounting of the
step's outputs (`AsyncEngine._dispatch` with metrics on) and the streamed text delta (`TextStream.delta`), for B
sequences that each commit K tokens a step of a real text in SmolLM2's tokenizer.

    PYTHONPATH=. python3 tools/diag/commit_cost.py [--batch 64] [--tokens-per-step 3] [--stop STR ...]

No model runs: the engine's commit is called on sequences alone. It prints a markdown table: microseconds per
sequence per step, averaged over each range of output lengths. A record of where host time goes, not a fast path.
"""
from __future__ import annotations

import argparse
import pathlib
import time
import types

from eyas.engine.detokenizer import IncrementalDetokenizer, decoding_of
from eyas.engine.engine import LLMEngine
from eyas.engine.sequence import Sequence
from eyas.loader.gguf import load_gguf_tokenizer
from eyas.loader.resolve import smollm2_path
from eyas.sampling_params import SamplingParams
from eyas.serve.async_engine import AsyncEngine, _Tracker
from eyas.serve.metrics import Metrics
from eyas.engine.detokenizer import TextStream

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Scheduler:
    def finish(self, seq, reason):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens-per-step", type=int, default=3)
    ap.add_argument("--stop", nargs="*", default=[], help="stop strings (that never occur in the text)")
    ap.add_argument("--max-output", type=int, default=8192)
    args = ap.parse_args()
    tok = load_gguf_tokenizer(smollm2_path())
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok.encode(text)[:args.max_output]
    # the engine's commit on sequences alone: it needs the engine's limits, its scheduler's finish and its own helpers
    engine = types.SimpleNamespace(max_model_len=1 << 30, scheduler=_Scheduler(), seqs={},
                                   _decode_added=LLMEngine._decode_added)
    engine._finish = types.MethodType(LLMEngine._finish, engine)
    # the server's loop on an engine of depth-3 speculation (only what `_dispatch` reads of it)
    loop_engine = types.SimpleNamespace(step_counts={"prefill": 0, "decode": 0}, draft=object(),
                                        tree=types.SimpleNamespace(max_depth=3),
                                        blocks=types.SimpleNamespace(num_usable=1, num_used=0),
                                        scheduler=types.SimpleNamespace(running=[], waiting=[]))
    server_loop = AsyncEngine(loop_engine, Metrics("m"))
    seqs, streams = [], []
    for _ in range(args.batch):
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=1 << 30, stop=args.stop or None), 0)
        seq.detok = IncrementalDetokenizer(tok, 3, decoding_of(tok))
        seqs.append(seq)
        streams.append(TextStream(args.stop))
        server_loop._trackers[seq.request_id] = _Tracker(None, 0, time.perf_counter())
    K, B = args.tokens_per_step, args.batch
    edges = [e for e in (256, 512, 1024, 2048, 4096, 8192, 16384) if e <= len(ids)]
    print("| output tokens | `_commit` us / sequence / step | loop accounting | stream delta |")
    print("| --- | --- | --- | --- |")
    pos, lo = 0, 0
    for hi in edges:
        t_commit = t_loop = t_stream = 0.0
        steps = 0
        while pos + K <= hi:
            chunk = ids[pos:pos + K]
            pos += K
            for s in seqs:  # what `LLMEngine._decoded` counts: a verify call whose path reached depth K - 1
                st = s.stats
                st.target_calls += 1
                st.committed += K
                st.accepted_by_depth = st.accepted_by_depth or [0] * (K - 1)
                for d in range(K - 1):
                    st.accepted_by_depth[d] += 1
            t0 = time.perf_counter()
            outs = [LLMEngine._commit(engine, s, chunk) for s in seqs]
            t1 = time.perf_counter()
            server_loop._dispatch(outs)
            server_loop._outbox.clear()  # the deliveries, for the event loop: none runs here
            t2 = time.perf_counter()
            for stream, out in zip(streams, outs):
                out.num_output_tokens
                stream.delta(out)
            t_stream += time.perf_counter() - t2
            t_loop += t2 - t1
            t_commit += t1 - t0
            steps += 1
        print(f"| {lo}-{hi} | {1e6 * t_commit / steps / B:.2f} | {1e6 * t_loop / steps / B:.2f} | "
              f"{1e6 * t_stream / steps / B:.2f} |")
        lo = hi


if __name__ == "__main__":
    main()
