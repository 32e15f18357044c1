"""Training data for EAGLE drafts: conversations in, padded token batches with an assistant-only loss mask out.

Input files are JSON lines, optionally gzipped. A record is one of
* a conversation, `{"conversations": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}` (the layout of
  `../shared/data/sharegpt`); `"messages"` instead of `"conversations"`, and ShareGPT's original
  `{"from": "human"|"gpt", "value": ...}` spelling, are accepted too;
* already tokenised, `{"input_ids": [...], "loss_mask": [0/1, ...]}` (tests, or data made elsewhere).

Conversations are rendered with the target's chat template. The mask marks the tokens of assistant turns (their
content and the end-of-turn tokens the template writes after it), not the generation prompt before them, the system
prompt or the user turns.

Batching pads on the right (no packing: a causal model never sees across conversations) and groups conversations of
similar length, so padding stays small. The batch plan of an epoch is a pure function of (seed, epoch), which is
what makes resuming exact: the trainer only records the epoch and the batch index.
"""
from __future__ import annotations

import gzip
import io
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


@dataclass
class Example:
    ids: np.ndarray  # [T] int32 token ids
    mask: np.ndarray  # [T] bool, True on assistant tokens

    def __len__(self) -> int:
        return len(self.ids)

    def prompt_ids(self) -> list[int]:
        """Tokens before the first assistant token: the first user turn plus the generation prompt."""
        first = int(np.argmax(self.mask)) if self.mask.any() else len(self.ids)
        return self.ids[:first].tolist()


_OPENERS = {".gz": gzip.open, ".xz": lzma.open}  # compressed text: a third smaller with xz for conversations


def read_lines(path: str | Path, flag: str, what: str) -> list[str]:
    """The lines of a text file given as `flag` (its right ends stripped; blank lines and '#' comments skipped), for
    files of openings, templates and the like; a clear error when it is missing or holds no `what`."""
    if not Path(path).is_file():
        raise ValueError(f"{flag} {str(path)!r}: no such file")
    lines = [ln.rstrip() for ln in Path(path).read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"{flag} {str(path)!r}: no {what} in it")
    return lines


def open_text(path: str | Path, mode: str = "r") -> io.TextIOBase:
    """A UTF-8 text file, gzip- (.gz) or xz-compressed (.xz) or plain by its suffix; `mode` "w" writes it (its
    directory created)."""
    if mode not in ("r", "w"):
        raise ValueError(f"mode must be 'r' or 'w', got {mode!r}")
    path = Path(path)
    if mode == "w":
        path.parent.mkdir(parents=True, exist_ok=True)
    return _OPENERS.get(path.suffix, open)(path, mode + "t", encoding="utf-8")


def read_jsonl(paths: str | Path | Iterable[str | Path]) -> Iterator[dict]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for path in paths:
        if not Path(path).exists():
            raise ValueError(f"data file {path} does not exist")
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None


def normalize_messages(record: dict, need_assistant: bool = True) -> list[dict] | None:
    """The record's messages as [{"role", "content"}], or None if it holds no usable conversation (for training:
    one with an assistant turn; `need_assistant=False` takes prompts alone, as `make-distill-data` does)."""
    msgs = record.get("conversations", record.get("messages"))
    if not isinstance(msgs, list):
        return None
    out = []
    for m in msgs:
        if not isinstance(m, dict):
            return None
        role = _ROLES.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out if not need_assistant or any(m["role"] == "assistant" for m in out) else None


def conversation_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_assistant) pieces, by rendering growing prefixes."""
    segs: list[tuple[str, bool]] = []
    prev = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            with_prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True) if i else ""
            if not with_prompt.startswith(prev):
                raise ValueError("the chat template does not render conversations prefix by prefix")
            segs.append((with_prompt[len(prev):], False))
            prev = with_prompt
        text = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not text.startswith(prev):
            raise ValueError("the chat template does not render conversations prefix by prefix")
        segs.append((text[len(prev):], m["role"] == "assistant"))
        prev = text
    return [(t, a) for t, a in segs if t]


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> Example | None:
    segs = conversation_segments(tokenizer, messages)
    enc = tokenizer.backend.encode_batch([t for t, _ in segs], add_special_tokens=False)
    ids: list[int] = []
    mask: list[bool] = []
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
        mask.append(False)
    for e, (_, is_asst) in zip(enc, segs):
        ids.extend(e.ids)
        mask.extend([is_asst] * len(e.ids))
    return make_example(ids, mask, max_len)


def make_example(ids, mask, max_len: int) -> Example | None:
    ids = np.asarray(ids, dtype=np.int32)[:max_len]
    mask = np.asarray(mask, dtype=bool)[:max_len]
    if len(ids) != len(mask):
        raise ValueError(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    # the draft's loss at position t is on token t+2: a sequence needs 3 tokens and a masked token past index 1
    if len(ids) < 3 or not mask[2:].any():
        return None
    return Example(ids, mask)


def first_answer_tokens(ex: Example, n: int) -> Example | None:
    """`ex` with only the first `n` tokens of each assistant turn (a run of masked tokens) left in its loss mask, cut
    after the last one that stays; None when nothing the draft can learn from is left. Where speculation is judged
    (a chat answer's first ~128 tokens), long answers' tails -- often repetitive at T=0 -- would otherwise dominate
    the loss."""
    if n < 1:
        raise ValueError(f"the answer tokens kept must be >= 1, got {n}")
    idx = np.arange(len(ex.mask))
    starts = ex.mask & ~np.concatenate([[False], ex.mask[:-1]])
    run_start = np.maximum.accumulate(np.where(starts, idx, 0))
    keep = ex.mask & (idx - run_start < n)
    if not keep.any():
        return None
    last = int(idx[keep][-1])
    return make_example(ex.ids[: last + 1], keep[: last + 1], last + 1)


_WORKER_TOK = None


def _tokenize_worker(args):
    msgs_list, max_len = args
    return [tokenize_conversation(_WORKER_TOK, m, max_len) for m in msgs_list]


def load_examples(paths, tokenizer=None, max_len: int = 2048, limit: int | None = None,
                  vocab_size: int | None = None, workers: int | None = None) -> list[Example]:
    """Read and tokenise every usable record of the files (in file order). Conversations are rendered and
    tokenised by `workers` processes (default: up to 16, one per CPU; 1: in this process)."""
    import os

    items: list = []  # an Example, or the messages of a conversation still to tokenise
    for rec in read_jsonl(paths):
        if limit is not None and len(items) >= limit:
            break
        if "input_ids" in rec:
            ex = make_example(rec["input_ids"], rec.get("loss_mask", [1] * len(rec["input_ids"])), max_len)
            if ex is not None:
                items.append(ex)
            continue
        msgs = normalize_messages(rec)
        if msgs is None:
            continue
        if tokenizer is None:
            raise ValueError("conversation records need a tokenizer with a chat template (this target has none)")
        items.append(msgs)
    todo = [i for i, x in enumerate(items) if not isinstance(x, Example)]
    if workers is None:
        workers = min(16, os.cpu_count() or 1)
    if todo and workers > 1 and len(todo) >= 256:
        import multiprocessing as mp
        global _WORKER_TOK
        _WORKER_TOK = tokenizer
        n = max(len(todo) // (workers * 4), 1)
        chunks = [todo[i: i + n] for i in range(0, len(todo), n)]
        try:
            with mp.get_context("fork").Pool(workers) as pool:
                done = pool.map(_tokenize_worker, [([items[i] for i in c], max_len) for c in chunks])
        finally:
            _WORKER_TOK = None
        for c, exs in zip(chunks, done):
            for i, ex in zip(c, exs):
                items[i] = ex
    else:
        for i in todo:
            items[i] = tokenize_conversation(tokenizer, items[i], max_len)
    out = [x for x in items if x is not None]
    if vocab_size is not None:
        for ex in out:
            if ex.ids.min() < 0 or ex.ids.max() >= vocab_size:
                raise ValueError(f"token id out of range [0, {vocab_size}) in the data")
    return out


def split_heldout(examples: list[Example], n_heldout: int, seed: int) -> tuple[list[Example], list[Example]]:
    """A fixed random sample of n_heldout examples, kept out of training."""
    n_heldout = min(n_heldout, max(len(examples) - 1, 0))
    perm = np.random.RandomState(seed + 7919).permutation(len(examples))
    held = set(perm[:n_heldout].tolist())
    train = [e for i, e in enumerate(examples) if i not in held]
    heldout = [examples[i] for i in sorted(held)]
    return train, heldout


def plan_epoch(lengths: list[int] | np.ndarray, batch_tokens: int, max_batch: int, seed: int, epoch: int,
               group: int = 64) -> list[list[int]]:
    """Batches (lists of example indices) for one epoch: shuffle, sort within groups of `group` batches' worth of
    examples by length, cut into batches whose padded size B * max_len stays within batch_tokens, shuffle the
    batches. Deterministic in (seed, epoch)."""
    lengths = np.asarray(lengths)
    rng = np.random.RandomState((seed * 1_000_003 + epoch) % (2 ** 32))
    perm = rng.permutation(len(lengths))
    mean = max(int(lengths.mean()) if len(lengths) else 1, 1)
    chunk = max(group * max(batch_tokens // mean, 1), 1)
    batches: list[list[int]] = []
    for start in range(0, len(perm), chunk):
        part = sorted(perm[start: start + chunk].tolist(), key=lambda i: (-lengths[i], i))
        cur: list[int] = []
        cur_max = 0
        for i in part:
            L = int(lengths[i])
            new_max = max(cur_max, L)
            if cur and (new_max * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch):
                batches.append(cur)
                cur, new_max = [], L
            cur.append(i)
            cur_max = new_max
        if cur:
            batches.append(cur)
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def collate(examples: list[Example], idx: list[int], pad_id: int = 0,
            multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, T] int64 (right-padded with pad_id), mask [B, T] bool (False on padding). T is the longest example
    rounded up to `multiple`: fewer distinct shapes let the GPU libraries reuse their plans (cuDNN attention builds
    one per shape)."""
    T = max(len(examples[i]) for i in idx)
    T = -(-T // multiple) * multiple
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(idx), T), dtype=torch.bool)
    for r, i in enumerate(idx):
        e = examples[i]
        ids[r, : len(e)] = torch.from_numpy(e.ids.astype(np.int64))
        mask[r, : len(e)] = torch.from_numpy(e.mask)
    return ids, mask


def length_batches(lengths, batch_tokens: int) -> list[list[int]]:
    """Evaluation batches: the indices sorted by length, cut so that a batch's padded size (batch x its longest)
    stays within `batch_tokens` (a longer example goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * lengths[order[j]] <= batch_tokens:
            j += 1
        out.append(order[i:j])
        i = j
    return out
