"""Several `eyas bench latency` JSONs in one plot: ms per committed token (TTIT) against batch size, one line style
per run (e.g. TP = 1 against TP = 2) and one colour per mode, with each run's weight-read floor as a dotted line.

    python tools/diag/plot_latency_compare.py docs/bench/tp_l8b_tp1_s9.json docs/bench/tp_l8b_tp2_s9.json \
        --labels "TP 1" "TP 2" --title "Llama-3.1-8B shape" --out docs/bench/tp_l8b_s9.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="latency.json files")
    ap.add_argument("--labels", nargs="+", help="one per run (default: the file names)")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    labels = args.labels or [Path(r).stem for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"{len(args.runs)} runs but {len(labels)} labels")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = ["-", "--", "-.", ":"]
    colours: dict[str, str] = {}
    floors: list[float] = []
    for i, (path, label) in enumerate(zip(args.runs, labels)):
        run = json.loads(Path(path).read_text())
        rows = run["results"]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
            colour = colours.setdefault(mode, f"C{len(colours)}")
            ax.plot([r["batch"] for r in rs], [r["ttit_ms"] for r in rs], styles[i % len(styles)], marker="o",
                    color=colour, label=f"{mode}, {label}")
        floor = run["meta"].get("weight_read_floor_ms")
        if floor and all(abs(floor - f) > 0.01 * f for f in floors):  # one line per distinct floor
            floors.append(floor)
            ax.axhline(floor, color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"weight-read floor ({label}): {floor:.2f} ms", (1, floor), fontsize=7, color="grey",
                        xytext=(2, 2), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per committed token (TTIT)")
    ax.set_title(args.title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
