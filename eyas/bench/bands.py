"""`eyas bench bands`: the temperature bands that `eyas bench latency` runs at several temperatures argue for.

Sampled requests accept fewer draft tokens the hotter they are, so the speculation that wins at temperature 0 can
lose at 1 (session 59: every mode of SmolLM2's draft lost to plain decoding at 1 on an H100, the fitted tree still
won at 0.7). Given one `latency.json` per temperature (`eyas bench latency --temperature T --modes ...
--out DIR`), each run's fastest mode per batch size makes that temperature's dispatch
(`eyas.bench.latency.suggest_dispatch`; `plain` where no speculative mode won), and the bands join them
(`eyas.spec.dispatch.parse_bands`): a band begins halfway between two measured temperatures, neighbours with the
same dispatch merge, and the coldest run's dispatch serves every temperature below the first boundary.

A dispatch's `plain` entry below the hottest band is not quite plain decoding: the draft still reads the committed
tokens so that a later step can speculate (session 59: 0.92-0.93x of plain decoding, `smollm2-shape` on an H100).
`--plain-entry-cost 1.08` charges the plain rows that much more when they compete, so that a mode a few percent
slower than plain decoding, but faster than the entry, keeps its place. Plain bands from some temperature up (the
suggestion's last) cost no more than plain decoding where a step's requests are all that hot: such steps skip the
draft (`eyas.spec.dispatch.TreeDispatch.plain_from`; session 60: 1.01x / 0.96x at batch 1 / 16 on an H100).

    eyas bench bands DIR_T0/latency.json DIR_T07/latency.json DIR_T1/latency.json [--metric ttit|tpot]
        [--plain-entry-cost F]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def suggest_bands(runs: list[tuple[float, list[dict]]], metric: str = "ttit",
                  plain_entry_cost: float = 1.0) -> dict | None:
    """runs: (temperature, the rows of one `bench latency` run at it), any order, temperatures distinct and >= 0.
    `plain_entry_cost`: the factor plain rows' times are charged when they compete (see the module docstring).
    Returns {"spec": the banded speculation, "per_temperature": {T: its dispatch or "plain"}, "metric"}, or None
    when no speculative mode won at any measured temperature and batch size."""
    from eyas.bench.latency import suggest_dispatch
    from eyas.spec.dispatch import parse_bands
    if not runs:
        raise ValueError("suggest_bands needs at least one run")
    temps = sorted(t for t, _ in runs)
    if any(t < 0 for t in temps) or len(set(temps)) != len(temps):
        raise ValueError(f"suggest_bands: temperatures must be distinct and >= 0, got {temps}")
    if not plain_entry_cost >= 1.0:
        raise ValueError(f"suggest_bands: plain_entry_cost must be >= 1, got {plain_entry_cost}")
    choice: dict[float, str] = {}
    for t, rows in sorted(runs, key=lambda r: r[0]):
        if plain_entry_cost != 1.0:
            rows = [r if r["mode"] != "plain" else r | {k: r[k] * plain_entry_cost for k in ("ttit_ms", "tpot_ms")
                                                        if r.get(k) is not None} for r in rows]
        s = suggest_dispatch(rows, metric)
        choice[t] = s["spec"] if s is not None else "plain"
    if all(c == "plain" for c in choice.values()):
        return None
    parts = [choice[temps[0]]]
    for lo, hi in zip(temps, temps[1:]):
        if choice[hi] != choice[lo]:
            parts.append(f"{round((lo + hi) / 2, 4):g}={choice[hi]}")
    spec = "|".join(parts)
    parse_bands(spec)  # every SPEC valid
    return {"metric": metric, "spec": spec, "per_temperature": {f"{t:g}": c for t, c in choice.items()}}


def read_run(path: str) -> tuple[float, list[dict]]:
    """(temperature, rows) of a `bench latency` JSON file (ValueError for anything else)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable `eyas bench latency` JSON file ({e})") from None
    meta, rows = (data.get("meta"), data.get("results")) if isinstance(data, dict) else (None, None)
    if not isinstance(meta, dict) or not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: no `meta` and `results` of `eyas bench latency`")
    if meta.get("simulated"):
        raise ValueError(f"{path}: simulated acceptance (random weights) says nothing of how a temperature accepts")
    return float(meta.get("temperature") or 0.0), rows


def main(args: argparse.Namespace) -> int:
    runs = [read_run(p) for p in args.runs]
    out = suggest_bands(runs, args.metric, args.plain_entry_cost)
    if out is None:
        print("no speculative mode won at any measured temperature and batch size: decode without speculation")
        return 0
    print(f"| temperature | dispatch (fastest by {args.metric.upper()} per batch size) |")
    print("| --- | --- |")
    for t, c in out["per_temperature"].items():
        print(f"| {t} | {c} |")
    print(f"\n--speculation \"{out['spec']}\"")
    return 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("bands", help="the temperature bands of a speculation, from latency runs at several "
                                           "temperatures")
    p.add_argument("runs", nargs="+", help="`eyas bench latency` JSON files, one per temperature")
    p.add_argument("--metric", default="ttit", choices=["ttit", "tpot"],
                   help="what each batch size's fastest mode is judged by (default: ttit)")
    p.add_argument("--plain-entry-cost", type=float, default=1.0,
                   help="charge plain decoding's rows this factor when they compete: a dispatch's plain entry "
                        "still runs the draft's catch-up (1.08 measured for SmolLM2 on an H100, session 59)")
    p.set_defaults(func=main)
    return p
