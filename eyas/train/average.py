"""`eyas average-drafts`: one draft whose weights are the (weighted) mean of several drafts' ("a model soup").

Drafts fine-tuned from one checkpoint (continuations of the shipped draft under different losses or seeds) lie in one
basin of the loss; their mean often predicts better than any of them (Wortsman et al., 2022, "Model soups"). The drafts
must share their architecture: the same config.json (the layer count, widths, feature layers, ...), the same tensors
and shapes, and the same draft vocabulary if they have one. Means are taken in float32 and stored in the first draft's
dtype; its config.json (with its serving choices, `eyas_speculation` and `eyas_draft_quant`, which alone may
differ) is copied, and `training.json` says what was averaged.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from eyas.loader.hf import load_weights, read_config
from eyas.loader.resolve import DEFAULT_MODEL, draft_dir

WEIGHTS = "model.safetensors"
VOCAB = "draft_vocab.safetensors"
SERVING_KEYS = {"eyas_speculation", "eyas_draft_quant"}  # how a draft is served, not what it is: may differ


def _read(path: Path) -> tuple[dict, dict]:
    """A draft's config.json and tensors, read as `load_draft` reads them (safetensors, sharded or not, or .bin)."""
    if not (path / "config.json").is_file():
        raise ValueError(f"draft {str(path)!r}: expected config.json and weights (an EAGLE checkpoint directory)")
    return read_config(path), load_weights(path, allow_bin=True)


def average_drafts(drafts: list[str], out: str, weights: list[float] | None = None,
                   model: str = DEFAULT_MODEL) -> dict:
    """Write to `out` the draft whose every tensor is sum_i w_i * tensor_i (w: `weights` normalised to sum 1, or
    equal). `drafts` are directories, or "default" for `model`'s shipped draft. Returns what training.json holds."""
    if len(drafts) < 2:
        raise ValueError(f"average-drafts needs at least two drafts, got {len(drafts)}")
    paths = [Path(draft_dir(model, d)) for d in drafts]
    if weights is None:
        weights = [1.0] * len(paths)
    if len(weights) != len(paths):
        raise ValueError(f"{len(weights)} weights for {len(paths)} drafts")
    if any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
    w = [x / sum(weights) for x in weights]
    cfg0, sd0 = _read(paths[0])
    vocab0 = (paths[0] / VOCAB).read_bytes() if (paths[0] / VOCAB).is_file() else None
    acc = {k: v.float() * w[0] for k, v in sd0.items()}
    for p, wi in zip(paths[1:], w[1:]):
        cfg, sd = _read(p)
        diff = sorted(k for k in cfg0.keys() | cfg.keys() if k not in SERVING_KEYS and cfg0.get(k) != cfg.get(k))
        if diff:
            raise ValueError(f"draft {str(p)!r}: config.json differs from {str(paths[0])!r}'s in {diff}; only drafts "
                             f"of one architecture can be averaged")
        if sd.keys() != sd0.keys():
            raise ValueError(f"draft {str(p)!r}: tensors {sorted(sd.keys() ^ sd0.keys())} are not in both drafts")
        bad = [k for k in sd if sd[k].shape != sd0[k].shape]
        if bad:
            raise ValueError(f"draft {str(p)!r}: shapes differ from {str(paths[0])!r}'s for {bad}")
        vocab = (p / VOCAB).read_bytes() if (p / VOCAB).is_file() else None
        if vocab != vocab0:
            raise ValueError(f"draft {str(p)!r}: its draft vocabulary ({VOCAB}) is not {str(paths[0])!r}'s")
        for k, v in sd.items():
            acc[k] += v.float() * wi
    o = Path(out)
    if o.resolve() in {p.resolve() for p in paths}:
        raise ValueError(f"--out {out!r} is one of the drafts averaged")
    o.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(sd0[k].dtype).contiguous() for k, v in acc.items()}, str(o / WEIGHTS))
    shutil.copyfile(paths[0] / "config.json", o / "config.json")
    if vocab0 is not None:
        (o / VOCAB).write_bytes(vocab0)
    sources = []
    for p in paths:
        t = p / "training.json"
        info = json.loads(t.read_text()) if t.is_file() else {}
        sources.append({"path": str(p), **{k: info[k] for k in ("steps", "tokens_seen", "init", "loss_weights", "seed",
                                                                "date", "average_of") if k in info}})
    summary = {"average_of": sources, "weights": w, "tensors": len(acc), "out": str(o)}
    (o / "training.json").write_text(json.dumps(summary, indent=2))
    return summary


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `average-drafts` on the eyas CLI's subparsers."""
    p = subparsers.add_parser("average-drafts", help="average the weights of drafts of one architecture (a soup)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("drafts", nargs="+", help="EAGLE draft directories, or 'default' (the shipped draft of --model)")
    p.add_argument("--out", required=True, help="the averaged draft's directory")
    p.add_argument("--weights", type=float, nargs="+", default=None,
                   help="one weight per draft (normalised to sum 1; default: equal)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model whose shipped draft 'default' names")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    info = average_drafts(args.drafts, args.out, args.weights, args.model)
    print(json.dumps({"out": info["out"], "drafts": [s["path"] for s in info["average_of"]],
                      "weights": info["weights"]}))
    return 0


def main(argv=None) -> int:
    from eyas.cli import subcommand_main
    return subcommand_main(add_parser, "average-drafts", "eyas.train.average", argv)


if __name__ == "__main__":
    raise SystemExit(main())
