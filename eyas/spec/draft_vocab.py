"""A reduced draft vocabulary: the draft proposes only the K most frequent tokens (EAGLE-3's "d2t" map).

At every tree level the draft scores its candidates with the target's LM head: a [V, H] GEMV per level, which for a
128k-token vocabulary reads 1 GB (0.24 ms on an H200) three times per `chain:3` step, about a tenth of an 8B
speculative step. With a draft vocabulary of K sorted token ids, `draft_topk` scores only those K rows (a [K, H]
copy of them, gathered once) and maps the chosen indices back to target ids.

Exactness is untouched: the target verifies whatever the draft proposes, with the same acceptance rule; only the
acceptance rate can drop, where the target's next token lies outside the K. The draft is still trained on the
full vocabulary.

On disk: `draft_vocab.safetensors` (tensor `ids`, int64 [K], sorted) beside the draft's weights; `load_draft` attaches
it. `eyas make-draft-vocab` counts the assistant tokens of training data and writes the file, with the share of
those tokens the K cover (`coverage`) in its metadata.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.layers.topk import argmax, topk_indices
from eyas.spec.draft_quant import draft_head_logits

FILE = "draft_vocab.safetensors"


def eos_ids(target, tokenizer) -> set[int]:
    """The ids every draft vocabulary keeps (`select_draft_vocab`'s `always`): the target's EOS tokens and the
    tokenizer's."""
    eos = set(target.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def select_draft_vocab(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """The `size` most frequent token ids of `counts` [V] (ties: the lower id first), plus every id of `always`
    (e.g. the EOS tokens), sorted. Returns int64 [K] with K = size (or more, when `always` adds ids)."""
    V = counts.numel()
    if not 1 <= size <= V:
        raise ValueError(f"draft vocabulary size must be between 1 and the vocabulary ({V}), got {size}")
    order = torch.argsort(-counts.double() * (V + 1) + torch.arange(V, dtype=torch.float64))  # count desc, id asc
    ids = set(order[:size].tolist())
    for t in always:
        if not 0 <= int(t) < V:
            raise ValueError(f"token id {t} outside the vocabulary ({V})")
        ids.add(int(t))
    return torch.tensor(sorted(ids), dtype=torch.long)


def attach_draft_vocab(draft, target, ids: torch.Tensor | None) -> None:
    """Make `draft` propose only `ids` (None: the whole vocabulary again). Gathers the K rows of the target's LM
    head once; they live on the draft as non-persistent buffers (not part of its checkpoint weights)."""
    if getattr(draft, "head_quant", None) is not None:
        raise ValueError("this draft has a quantized head already: attach the draft vocabulary before quantizing")
    if getattr(draft, "head_norm", None) is not None:
        raise ValueError("an EAGLE-3 draft proposes from its own vocabulary (its d2t map) already")
    if ids is None:
        draft.vocab_ids = draft.vocab_head = None
        return
    head = target.lm_head.weight
    V = target.config.vocab_size
    if head.shape[0] != V:
        raise ValueError("a draft vocabulary needs the target's whole LM head on this rank (not vocabulary-parallel)")
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"draft vocabulary ids must be a non-empty 1-D list of ids in [0, {V})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("draft vocabulary ids must be distinct")
    ids = ids.to(head.device)
    draft.register_buffer("vocab_ids", ids, persistent=False)
    draft.register_buffer("vocab_head", head.detach()[ids].clone(), persistent=False)


def draft_logits(draft, target, h: torch.Tensor) -> torch.Tensor:
    """The draft's logits [..., K] over the tokens it may propose, from features h [..., H], in the head's dtype: its
    quantized head (`eyas.spec.draft_quant`: INT4 or FP8) if it has one, else the draft vocabulary's rows when one
    is attached (an EAGLE-3 draft's own head, after its `head_norm`), else the target's whole head (K = V)."""
    norm = getattr(draft, "head_norm", None)  # an EAGLE-3 draft's own final norm before its own head
    if norm is not None:
        h = norm(h)
    logits = draft_head_logits(draft, h)  # over the draft vocabulary if one is attached, else the whole one
    if logits is not None:
        return logits
    if getattr(draft, "vocab_ids", None) is None:
        return target.compute_logits(h, dtype=None)
    H = h.shape[-1]
    return (h.reshape(-1, H) @ draft.vocab_head.t()).view(*h.shape[:-1], -1)  # one 2-D matmul


def restrict_logits(draft, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., K] (the draft's, `draft_logits`) with -inf where `allowed` [B, words] (int32 token bitmasks
    over the target's vocabulary: guided decoding's, `eyas.spec.grammar`) forbids the token; a draft vocabulary's
    columns read their tokens' bits. A row that allows none of the columns (a draft vocabulary without the only
    tokens allowed, e.g. the end token) is left whole: all -inf would give NaN log-probabilities."""
    from eyas.spec.grammar import allowed_tokens
    bits = allowed_tokens(allowed, allowed.shape[-1] * 32)  # [B, words * 32]
    ids = getattr(draft, "vocab_ids", None)
    bits = bits[:, ids] if ids is not None else bits[:, :logits.shape[-1]]
    bits = bits | ~bits.any(-1, keepdim=True)
    return logits.masked_fill(~bits.view(bits.shape[0], *([1] * (logits.dim() - 2)), -1), float("-inf"))


def draft_topk(draft, target, h: torch.Tensor, k: int, allowed: torch.Tensor | None = None,
               adjust=None) -> torch.Tensor:
    """Target token ids [..., k] of the draft's top-k candidates from features h [B, ..., H]: over the draft
    vocabulary when one is attached, the whole vocabulary otherwise (`draft_logits`); only tokens that `allowed`
    ([B, words] bitmasks, guided decoding) allows, when given. `adjust(logits, columns)`: changes the logits in
    place before the top-k (repetition penalties, `eyas.layers.penalties`; `columns`: the draft vocabulary's ids or
    None)."""
    ids = getattr(draft, "vocab_ids", None)
    # the logits stay in the head's dtype: the float32 upcast of the same values would order them the same
    logits = draft_logits(draft, target, h)
    if allowed is not None:
        logits = restrict_logits(draft, logits, allowed)
    if adjust is not None:
        adjust(logits, ids)
    # k = 1 (every chain level): an argmax; otherwise a top-k (on CUDA each is two Triton launches, `eyas.kernels.
    # chunk_topk`)
    top = argmax(logits)[..., None] if k == 1 else topk_indices(logits, k)
    return top if ids is None else ids[top]


def draft_full_logits(draft, target, h: torch.Tensor) -> torch.Tensor:
    """The draft's float32 logits over the whole vocabulary [..., V], as its proposals rank them (for rank paths,
    `eyas make-tree`): `draft_logits`, with every token outside a draft vocabulary at -inf (the draft never proposes
    it)."""
    logits = draft_logits(draft, target, h).float()
    ids = getattr(draft, "vocab_ids", None)
    if ids is None:
        return logits
    full = logits.new_full((*h.shape[:-1], target.config.vocab_size), float("-inf"))
    full[..., ids] = logits
    return full


def save_draft_vocab(draft_dir: str | Path, ids: torch.Tensor, coverage: float | None = None) -> Path:
    path = Path(draft_dir) / FILE
    meta = {"size": str(int(ids.numel()))}
    if coverage is not None:
        meta["coverage"] = f"{coverage:.6f}"
    save_file({"ids": ids.to(torch.long).contiguous()}, str(path), metadata=meta)
    return path


def load_draft_vocab(draft_dir: str | Path) -> torch.Tensor | None:
    path = Path(draft_dir) / FILE
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("ids").to(torch.long)


def count_assistant_tokens(paths, tokenizer, vocab: int, max_len: int = 2048, limit: int | None = None):
    """Token counts [V] over the assistant turns of conversations (the same reader as `train-draft`)."""
    from eyas.train.data import load_examples
    counts = torch.zeros(vocab, dtype=torch.long)
    for ex in load_examples(paths, tokenizer, max_len, limit, vocab):
        ids = torch.as_tensor(ex.ids, dtype=torch.long)
        mask = torch.as_tensor(ex.mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab)
    return counts


# ---- CLI ---------------------------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("make-draft-vocab", help="write a draft's reduced vocabulary from training data",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="the target: 'smollm2', an HF directory or a .gguf file")
    p.add_argument("--data", nargs="+", required=True, help="jsonl[.gz] conversations (assistant turns are counted)")
    p.add_argument("--size", type=int, required=True, help="number of token ids the draft may propose")
    p.add_argument("--out", required=True, help="the draft's checkpoint directory (draft_vocab.safetensors goes there)")
    p.add_argument("--limit", type=int, default=None, help="read at most N conversations")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from eyas.loader.resolve import load_target
    out = Path(args.out)
    if not out.is_dir():
        raise SystemExit(f"eyas make-draft-vocab: {out} is not a directory (give the draft's checkpoint directory)")
    if args.size < 1:
        raise SystemExit(f"eyas make-draft-vocab: --size must be >= 1, got {args.size}")
    target, tokenizer = load_target(args.model, "cpu", "bfloat16")  # for its tokenizer, vocabulary and EOS ids
    vocab = target.config.vocab_size
    eos = eos_ids(target, tokenizer)
    del target
    counts = count_assistant_tokens(args.data, tokenizer, vocab, limit=args.limit)
    total = int(counts.sum())
    if total == 0:
        raise SystemExit("eyas make-draft-vocab: the data has no assistant tokens")
    try:
        ids = select_draft_vocab(counts, args.size, always=eos)
    except ValueError as e:
        raise SystemExit(f"eyas make-draft-vocab: {e}") from None
    coverage = float(counts[ids].sum()) / total
    path = save_draft_vocab(out, ids, coverage)
    print(json.dumps({"out": str(path), "size": int(ids.numel()), "vocab": vocab, "assistant_tokens": total,
                      "coverage": round(coverage, 6)}))
    return 0
