"""Write the first user turns of ShareGPT-style conversation files as prompt files for `eyas make-distill-data`.

    python tools/device/first_turns.py --out .stage/c2/p1.jsonl.gz ../shared/data/sharegpt/sharegpt-train-0{0,1}.jsonl.gz

Each record keeps the first user turn and an empty assistant placeholder (the turn make-distill-data regenerates);
turns longer than --max-chars are skipped. Used for run C of docs/draft-training.md.
"""
import argparse
import gzip
import json

from eyas.train.data import normalize_messages, read_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-chars", type=int, default=4000)
    args = ap.parse_args()
    n = 0
    with gzip.open(args.out, "wt", compresslevel=9) as f:
        for path in args.files:
            for i, rec in enumerate(read_jsonl(path)):
                msgs = normalize_messages(rec)
                users = [m for m in msgs or [] if m["role"] == "user"]
                if not users or not users[0]["content"].strip() or len(users[0]["content"]) > args.max_chars:
                    continue
                conv = [users[0], {"role": "assistant", "content": ""}]
                f.write(json.dumps({"id": f"{path}:{rec.get('id', i)}", "conversations": conv},
                                   ensure_ascii=False) + "\n")
                n += 1
    print(f"{n} prompts -> {args.out}")


if __name__ == "__main__":
    main()
