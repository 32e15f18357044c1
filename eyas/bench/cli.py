"""`eyas bench {tpc,latency,peers,soak}`."""
from __future__ import annotations


def add_parser(sub) -> None:
    from eyas.bench import latency, peers, soak, tpc
    bench = sub.add_parser("bench", help="benchmarks: tpc (draft quality), latency (speed by batch size), "
                                         "peers (HF transformers), soak (random traffic for a while)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    tpc.add_tpc_parser(bsub)
    latency.add_parser(bsub)
    peers.add_parser(bsub)
    soak.add_parser(bsub)
