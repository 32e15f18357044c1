"""Write the first user turns of ShareGPT-style conversation files as prompt files for `eyas make-distill-data`.

    python tools/device/first_turns.py --out .stage/c2/p1.jsonl.gz ../shared/data/sharegpt/sharegpt-train-0{0,1}.jsonl.gz

Each record keeps the first user turn and an empty assistant placeholder (the turn make-distill-data regenerates);
turns longer than --max-chars are skipped. Used for run C of docs/draft-training.md. `--later`: every user turn
after the first instead, each as a prompt of its own (turns shorter than --min-chars skipped: "continue", "thanks");
run S (session 45) answers them as a kind of data no draft had seen.
"""
import argparse
import gzip
import json
import random

from eyas.train.data import normalize_messages, read_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-chars", type=int, default=4000)
    ap.add_argument("--min-chars", type=int, default=1)
    ap.add_argument("--later", action="store_true", help="the user turns after the first, one prompt each")
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="write the prompts in a random order (a time-budgeted answering then samples every file)")
    args = ap.parse_args()
    lines = []
    for path in args.files:
        for i, rec in enumerate(read_jsonl(path)):
            msgs = normalize_messages(rec)
            users = [m for m in msgs or [] if m["role"] == "user"]
            for j, u in enumerate(users[1:] if args.later else users[:1], start=int(args.later)):
                if not u["content"].strip() or not args.min_chars <= len(u["content"]) <= args.max_chars:
                    continue
                conv = [u, {"role": "assistant", "content": ""}]
                rid = f"{path}:{rec.get('id', i)}" + (f":{j}" if args.later else "")  # a later turn: its index too
                lines.append(json.dumps({"id": rid, "conversations": conv}, ensure_ascii=False) + "\n")
    if args.shuffle is not None:
        random.Random(args.shuffle).shuffle(lines)
    with gzip.open(args.out, "wt", compresslevel=9) as f:
        f.writelines(lines)
    print(f"{len(lines)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
