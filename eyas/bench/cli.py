"""`eyas bench {tpc,latency,bands,peers,soak,serve}`."""
from __future__ import annotations


def add_parser(sub) -> None:
    from eyas.bench import bands, latency, peers, serve, soak, tpc
    bench = sub.add_parser("bench", help="benchmarks: tpc (draft quality), latency (speed by batch size), bands "
                                         "(temperature bands from latency runs), "
                                         "peers (HF transformers), soak (random traffic for a while), serve (an "
                                         "OpenAI-compatible server under load, ours or a peer's)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    tpc.add_tpc_parser(bsub)
    latency.add_parser(bsub)
    bands.add_parser(bsub)
    peers.add_parser(bsub)
    soak.add_parser(bsub)
    serve.add_parser(bsub)
