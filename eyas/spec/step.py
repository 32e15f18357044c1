"""The speculative step, on the device: draft -> verify -> accept -> commit.

`spec_step` reads only device tensors of fixed shapes (`DecodeInputs`) and makes no host synchronisation, so the
runner can call it directly or capture it whole in a CUDA graph per batch-size bucket. With no draft the tree is the
bare root and the step is plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.layers.attention import MetaBuilder, write_kv
from eyas.layers.sampler import logits_to_probs
from eyas.spec.drafter import catch_up, expand_tree
from eyas.spec.tree import Tree
from eyas.spec.verifier import accept_tree, accept_tree_greedy, simulate_accept


@dataclass
class DecodeInputs:
    """One decode step's inputs for B sequences (device tensors; padded rows have num_cached 0, block table 0)."""
    root_tokens: torch.Tensor  # [B] the last committed token x_n
    num_cached: torch.Tensor  # [B] n: target KV entries (positions 0..n-1)
    num_draft_cached: torch.Tensor  # [B] draft KV entries
    block_tables: torch.Tensor  # [B, W]
    catchup_tokens: torch.Tensor | None  # [B, P] tokens x_{t+1} for t = num_draft_cached .. n-1 (padded)
    catchup_hidden: torch.Tensor | None  # [B, P, H] target hidden h_t for the same t (None without a draft)
    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B]
    max_context_len: int  # host-side bound on num_cached (the reference attention's gather width)

    def fill_from(self, other: "DecodeInputs") -> None:
        """Copy a step's inputs (n <= B rows) into these static (CUDA graph) buffers in place. Rows n..B-1 become
        padding: block tables of zeros, so everything they write lands in the scratch block 0."""
        n = other.root_tokens.shape[0]
        for name in ("root_tokens", "num_cached", "num_draft_cached", "temperature", "top_k", "seeds",
                     "block_tables", "catchup_tokens"):
            buf = getattr(self, name)
            if buf is not None:
                buf.zero_()
                src = getattr(other, name)
                if buf.dim() == 2:
                    buf[:n, : src.shape[1]].copy_(src)
                else:
                    buf[:n].copy_(src)
        self.top_p.fill_(1.0)
        self.top_p[:n].copy_(other.top_p)
        if self.catchup_hidden is not None:
            self.catchup_hidden[:n].copy_(other.catchup_hidden)


@dataclass
class DecodeOutputs:
    path_tokens: torch.Tensor  # [B, D+1] tokens of the accepted path, root first (valid up to num_accepted)
    num_accepted: torch.Tensor  # [B] draft tokens accepted
    bonus: torch.Tensor  # [B] the token sampled after the accepted path
    accepted_hidden: torch.Tensor | None  # [B, D+1, H] target hidden states along the path (for the draft)


def spec_step(target, draft, tree: Tree, cache, draft_cache, inp: DecodeInputs, block_size: int,
              use_triton: bool = False, simulated_accept: torch.Tensor | None = None,
              all_greedy: bool = False) -> DecodeOutputs:
    """One speculative step for every sequence.

    Before: the target KV holds positions 0..n-1 of each sequence, the last committed token x_n has none; the draft
    KV holds 0..d-1 and `catchup_*` carry the committed pairs (x_{t+1}, h_t), t = d..n-1, it has not read.
    `all_greedy`: every request has temperature 0, so acceptance needs only the target's argmax (no sort over the
    vocabulary); the result is the same as the general path's. `simulated_accept` (benchmarks of random-weight models): per-depth acceptance rates replace the real acceptance.

    After: the target KV holds 0..n+m (root and the m accepted draft tokens; nothing of rejected branches), the draft
    KV holds 0..n-1, and the outputs give the new tokens (accepted path + bonus) and the target's hidden states along
    the path, which are the draft's next catch-up pairs.
    """
    B = inp.root_tokens.shape[0]
    device = inp.root_tokens.device
    N1 = tree.num_nodes + 1
    n = inp.num_cached
    node_tokens = torch.zeros(B, N1, dtype=torch.long, device=device)
    node_tokens[:, 0] = inp.root_tokens

    meta = MetaBuilder(inp.block_tables, block_size, inp.max_context_len, use_triton)

    # draft: read the committed history, then expand the tree level by level
    if tree.num_nodes:
        lens = n - inp.num_draft_cached
        out = catch_up(draft, target, draft_cache, inp.catchup_tokens, inp.catchup_hidden, lens,
                       inp.num_draft_cached, meta)
        root_h = out[torch.arange(B, device=device), (lens - 1).clamp(min=0)]
        expand_tree(draft, target, draft_cache, tree, root_h, n, node_tokens, meta)

    # verify: one target forward over root + tree; split tree attention; K/V stashed, not cached
    positions = n[:, None] + tree.depth.to(device)[None, :]
    mask = tree.ancestor_mask.to(device)[None].expand(B, N1, N1)
    vmeta = meta(n, mask, stash=True)
    hidden = target(node_tokens, positions, vmeta, cache)
    logits = target.compute_logits(hidden)
    V = logits.shape[-1]

    # accept: the longest accepted path and a bonus token (greedy or lossless speculative sampling)
    if simulated_accept is not None:  # benchmarks of random-weight models only
        path, num_accepted, bonus = simulate_accept(node_tokens, tree, simulated_accept, inp.seeds, n,
                                                    logits.argmax(-1))
    elif all_greedy:
        path, num_accepted, bonus = accept_tree_greedy(logits.argmax(-1), node_tokens, tree)
    else:
        probs = logits_to_probs(logits.view(B * N1, V), inp.temperature.repeat_interleave(N1),
                                inp.top_k.repeat_interleave(N1), inp.top_p.repeat_interleave(N1)).view(B, N1, V)
        path, num_accepted, bonus = accept_tree(probs, node_tokens, tree, inp.seeds, n)

    # commit: the accepted path's K/V go to positions n..n+m
    D1 = path.shape[1]
    rows = torch.arange(B, device=device)[:, None]
    node = path.clamp(min=0)
    steps = torch.arange(D1, device=device)[None, :]
    slots = meta.slots(n[:, None] + steps, steps <= num_accepted[:, None])
    for layer, (k, v) in vmeta.new_kv.items():
        if use_triton:
            from eyas.kernels import commit_tree_kv_triton
            commit_tree_kv_triton(cache.k[layer], cache.v[layer], k, v, path, slots)
        else:
            write_kv(cache.k[layer], cache.v[layer], k[rows, node], v[rows, node], slots)
    accepted_hidden = hidden[rows, node] if draft is not None else None
    return DecodeOutputs(node_tokens.gather(1, node), num_accepted, bonus, accepted_hidden)
