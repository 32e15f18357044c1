"""The model runner: owns the device, the KV caches and the models, and executes scheduled steps.

Two kinds of step:
* `prefill(seqs, chunk_lens)`: runs prompt chunks through the target, writes their KV, samples the first token of
  sequences whose prompt is complete, and keeps the target's hidden states for the draft.
* `decode(seqs)`: one speculative step, draft -> verify -> accept -> commit (`spec_step` below). With no draft the
  tree is the bare root and this is plain decoding: one token per sequence.
"""
from __future__ import annotations

import torch

from eyas.cache.kv_cache import KVCache
from eyas.engine.sequence import Sequence
from eyas.layers.attention import AttentionMetadata, write_kv
from eyas.layers.sampler import logits_to_probs, sample_from, uniform
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM
from eyas.spec.drafter import draft_tree
from eyas.spec.tree import Tree
from eyas.spec.verifier import accept_tree


class StepBatch:
    """Host-side description of a batch turned into device tensors once per step."""

    def __init__(self, seqs: list[Sequence], block_size: int, device):
        self.seqs = seqs
        self.device = device
        self.block_size = block_size
        width = max(1, max(len(s.block_table) for s in seqs))
        bt = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            bt[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
        self.block_tables_cpu = bt
        self.block_tables = bt.to(device)
        p = [s.params for s in seqs]
        self.temperature = torch.tensor([x.temperature for x in p], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([x.top_k for x in p], dtype=torch.long, device=device)
        self.top_p = torch.tensor([x.top_p for x in p], dtype=torch.float32, device=device)
        self.seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=device)

    def slots(self, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Flat cache slots of (sequence, position) pairs [B, Q] (CPU tensors); -1 where not valid."""
        bs = self.block_size
        blk = self.block_tables_cpu.gather(1, (positions // bs).clamp(max=self.block_tables_cpu.shape[1] - 1))
        return torch.where(valid, blk * bs + positions % bs, torch.full_like(positions, -1)).to(self.device)

    def meta(self, context_lens: list[int], suffix_mask: torch.Tensor, slot_mapping=None, stash=False,
             past_kv=None) -> AttentionMetadata:
        return AttentionMetadata(
            block_tables=self.block_tables,
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=self.device),
            suffix_mask=suffix_mask.to(self.device),
            max_context_len=max(context_lens),
            block_size=self.block_size,
            slot_mapping=slot_mapping,
            stash=stash,
            past_kv=past_kv,
        )


def causal_block_mask(lens: list[int], Q: int) -> torch.Tensor:
    """[B, Q, Q]: causal among each sequence's valid tokens; padded rows see themselves (never an empty row)."""
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool))
    valid = torch.arange(Q)[None, :] < torch.tensor(lens)[:, None]  # [B, Q]
    return (causal[None] & valid[:, None, :]) | torch.eye(Q, dtype=torch.bool)[None]


def padded(rows: list[list[int]], Q: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(len(rows), Q, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    valid = torch.arange(Q)[None, :] < torch.tensor([len(r) for r in rows])[:, None]
    return out, valid


class ModelRunner:
    def __init__(self, target: LlamaForCausalLM, draft: EagleDraft | None, tree: Tree | None, num_blocks: int,
                 block_size: int):
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.target, self.draft = target, draft
        self.tree = tree if (tree is not None and draft is not None) else Tree.chain(0)
        self.block_size = block_size
        cfg = target.config
        self.cache = KVCache.allocate(cfg, cfg.num_hidden_layers, num_blocks, block_size, self.dtype, self.device)
        self.draft_cache = None
        if draft is not None:
            dc = draft.config
            self.draft_cache = KVCache.allocate(dc, dc.num_hidden_layers, num_blocks, block_size, self.dtype,
                                                self.device)

    @property
    def lookahead(self) -> int:
        """KV slots a decode step may commit per sequence: the root plus one per tree level."""
        return self.tree.max_depth + 1

    # ---- prefill ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunk_lens: list[int]) -> list[int | None]:
        """Run prompt chunks; return the first sampled token of each sequence whose prompt completes (else None)."""
        batch = StepBatch(seqs, self.block_size, self.device)
        Q = max(chunk_lens)
        ids, valid = padded([s.token_ids[s.num_cached: s.num_cached + c] for s, c in zip(seqs, chunk_lens)], Q)
        start = torch.tensor([s.num_cached for s in seqs])[:, None]
        positions = start + torch.arange(Q)[None, :]
        meta = batch.meta([s.num_cached for s in seqs], causal_block_mask(chunk_lens, Q),
                          slot_mapping=batch.slots(positions, valid))
        pos_dev = torch.where(valid, positions, torch.zeros_like(positions)).to(self.device)
        hidden = self.target(ids.to(self.device), pos_dev, meta, self.cache)

        last = torch.tensor(chunk_lens, device=self.device) - 1
        rows = torch.arange(len(seqs), device=self.device)
        logits = self.target.compute_logits(hidden[rows, last])
        probs = logits_to_probs(logits, batch.temperature, batch.top_k, batch.top_p)
        counters = torch.tensor([s.num_cached + c - 1 for s, c in zip(seqs, chunk_lens)], device=self.device)
        sampled = sample_from(probs, uniform(batch.seeds, counters, 0)).tolist()

        out: list[int | None] = []
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            if self.draft is not None:
                h = hidden[i, :c]
                s.pending_hidden = h if s.pending_hidden is None else torch.cat([s.pending_hidden, h])
            s.num_cached += c
            completes = s.num_cached == s.prefill_target
            out.append(sampled[i] if completes and s.num_output == 0 else None)
        return out

    # ---- decode: one speculative step -----------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[int]]:
        """spec_step: draft -> verify -> accept -> commit, for every sequence at once.

        Before: the target KV holds positions 0..n-1 of each sequence (n = num_cached), the last committed token
        x_n has no KV yet, and the draft KV plus `pending_hidden` cover the same history (see Sequence).
        After: the target KV holds 0..n+m (the root and the m accepted draft tokens), the new committed tokens are
        the m accepted ones plus a bonus token sampled from the target, and `pending_hidden` holds the target's
        hidden states at the accepted positions, for the draft to read next step. Rejected branches leave nothing
        in any cache. Returns (new tokens per sequence, accepted draft tokens per sequence).
        """
        tree = self.tree
        batch = StepBatch(seqs, self.block_size, self.device)
        B, N1 = len(seqs), tree.num_nodes + 1
        n = [s.num_cached for s in seqs]
        node_tokens = torch.zeros(B, N1, dtype=torch.long, device=self.device)
        node_tokens[:, 0] = torch.tensor([s.token_ids[-1] for s in seqs], device=self.device)
        if tree.num_nodes:
            draft_tree(self.draft, self.target, self.draft_cache, tree, batch, node_tokens)

        # verify: one target forward over root + tree, split tree attention, K/V stashed (not yet committed)
        n_dev = torch.tensor(n, device=self.device)
        positions = n_dev[:, None] + tree.depth.to(self.device)[None, :]
        meta = batch.meta(n, tree.ancestor_mask[None].expand(B, N1, N1), stash=True)
        hidden = self.target(node_tokens, positions, meta, self.cache)
        logits = self.target.compute_logits(hidden)  # [B, N+1, V]
        V = logits.shape[-1]
        probs = logits_to_probs(logits.view(B * N1, V), batch.temperature.repeat_interleave(N1),
                                batch.top_k.repeat_interleave(N1), batch.top_p.repeat_interleave(N1)).view(B, N1, V)
        path, num_accepted, bonus = accept_tree(probs, node_tokens, tree, batch.seeds, n_dev)

        # commit: the accepted path's K/V go to positions n..n+m of the paged cache
        D1 = path.shape[1]
        rows = torch.arange(B, device=self.device)[:, None]
        node = path.clamp(min=0)
        keep = torch.arange(D1, device=self.device)[None, :] <= num_accepted[:, None]
        commit_pos = n_dev[:, None] + torch.arange(D1, device=self.device)[None, :]
        slots = batch.slots(commit_pos.cpu(), keep.cpu())
        for layer, (k, v) in meta.new_kv.items():
            write_kv(self.cache.k[layer], self.cache.v[layer], k[rows, node], v[rows, node], slots)

        # the one host synchronisation of the step
        path_tokens = node_tokens.gather(1, node)
        m_host = num_accepted.tolist()
        tok_host = path_tokens.tolist()
        bonus_host = bonus.tolist()
        accepted_hidden = hidden[rows, node] if self.draft is not None else None
        new_tokens = []
        for i, s in enumerate(seqs):
            m = m_host[i]
            new_tokens.append(tok_host[i][1: m + 1] + [bonus_host[i]])
            s.num_cached += m + 1
            if accepted_hidden is not None:
                s.pending_hidden = accepted_hidden[i, : m + 1]
        return new_tokens, m_host
