"""What the diagnostic tools of tools/diag share: MT-Bench first turns through a model's chat template, and rows
printed as JSON lines as they come, then saved with the arguments and the date."""
from __future__ import annotations

import json
import time


def chat_prompts(tokenizer, records) -> list[list[int]]:
    """Each record's first user turn (`eyas.bench.tpc.read_prompts`) through the chat template, as token ids."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["text"]}]))
            for r in records]


def emit(rows: list, row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def save(path: str | None, args, rows: list, **extra) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(args=vars(args), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **extra,
                           rows=rows), f, indent=1)
