"""The model runner: owns the device, the KV caches and the models, and executes scheduled steps.

* `prefill(seqs, chunk_lens)`: runs prompt chunks through the target (writing their KV), lets the draft read the
  committed pairs the chunk completes, and samples the first token of sequences whose prompt is complete.
* `decode(seqs)`: one speculative step (`eyas.spec.step.spec_step`: draft -> verify -> accept -> commit), run eagerly
  or replayed from a CUDA graph. With no draft the tree is the bare root: plain decoding.
"""
from __future__ import annotations

import torch

from eyas.cache.kv_cache import KVCache
from eyas.engine.sequence import Sequence
from eyas.layers.attention import MetaBuilder
from eyas.layers.sampler import logits_to_probs, sample_from, uniform
from eyas.models.eagle import EagleDraft
from eyas.models.llama import LlamaForCausalLM
from eyas.spec.drafter import catch_up, causal_mask
from eyas.spec.step import DecodeInputs, DecodeOutputs, spec_step
from eyas.spec.tree import Tree


def padded(rows: list[list[int]], Q: int) -> torch.Tensor:
    out = torch.zeros(len(rows), Q, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def block_tables_of(seqs: list[Sequence], width: int | None = None) -> torch.Tensor:
    width = width or max(1, max(len(s.block_table) for s in seqs))
    return padded([s.block_table for s in seqs], width)


def all_greedy(seqs: list[Sequence]) -> bool:
    return all(s.params.temperature == 0.0 for s in seqs)


class ModelRunner:
    def __init__(self, target: LlamaForCausalLM, draft: EagleDraft | None, tree: Tree | None, num_blocks: int,
                 block_size: int, use_triton: bool | None = None, cuda_graphs: bool = False,
                 max_model_len: int = 0):
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.target, self.draft = target, draft
        self.tree = (tree if (tree is not None and draft is not None) else Tree.chain(0)).to(self.device)
        self.block_size = block_size
        self.use_triton = (self.device.type == "cuda") if use_triton is None else use_triton
        if self.use_triton:  # fused projections and kernels (eyas.models.fused): in place, after any TP sharding
            from eyas.models.fused import enable_fast_path
            for m in (target, draft):
                if m is not None:
                    enable_fast_path(m)
        cfg = target.config
        self.cache = KVCache.allocate(cfg, cfg.num_hidden_layers, num_blocks, block_size, self.dtype, self.device)
        self.draft_cache = None
        if draft is not None:
            dc = draft.config
            self.draft_cache = KVCache.allocate(dc, dc.num_hidden_layers, num_blocks, block_size, self.dtype,
                                                self.device)
        self.simulated_accept: torch.Tensor | None = None  # benchmarks: per-depth acceptance rates (see spec_step)
        self.graphs = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("CUDA graphs need device='cuda'")
            from eyas.engine.cuda_graph import GraphedStep
            self.graphs = GraphedStep(self, max_model_len)

    @property
    def lookahead(self) -> int:
        """KV slots a decode step may commit per sequence: the root plus one per tree level. Also the most
        committed pairs the draft has to catch up on at a decode step."""
        return self.tree.max_depth + 1

    def _meta(self, seqs, max_context_len: int) -> MetaBuilder:
        return MetaBuilder(block_tables_of(seqs).to(self.device), self.block_size, max_context_len, self.use_triton)

    # ---- prefill ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunk_lens: list[int]) -> list[int | None]:
        """Run prompt chunks; return the first sampled token of each sequence whose prompt completes (else None)."""
        dev = self.device
        B, Q = len(seqs), max(chunk_lens)
        meta = self._meta(seqs, max(s.num_cached for s in seqs))
        ids = padded([s.token_ids[s.num_cached: s.num_cached + c] for s, c in zip(seqs, chunk_lens)], Q).to(dev)
        start = torch.tensor([s.num_cached for s in seqs], device=dev)
        lens = torch.tensor(chunk_lens, device=dev)
        ar = torch.arange(Q, device=dev)[None, :]
        valid = ar < lens[:, None]
        m = meta(start, causal_mask(lens, Q), slot_mapping=meta.slots(start[:, None] + ar, valid))
        hidden = self.target(ids, torch.where(valid, start[:, None] + ar, 0), m, self.cache)

        rows = torch.arange(B, device=dev)
        logits = self.target.compute_logits(hidden[rows, lens - 1])
        p = [s.params for s in seqs]
        probs = logits_to_probs(logits, torch.tensor([x.temperature for x in p], device=dev),
                                torch.tensor([x.top_k for x in p], device=dev),
                                torch.tensor([x.top_p for x in p], device=dev))
        seeds = torch.tensor([s.seed for s in seqs], device=dev)
        sampled = sample_from(probs, uniform(seeds, start + lens - 1, 0))
        if self.draft is not None:
            self._draft_prefill(seqs, chunk_lens, hidden, meta)
        sampled = sampled.tolist()
        out: list[int | None] = []
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            s.num_cached += c
            out.append(sampled[i] if s.num_cached == s.prefill_target and s.num_output == 0 else None)
        return out

    def _draft_prefill(self, seqs, chunk_lens, hidden, meta) -> None:
        """The draft reads the pairs (x_{t+1}, h_t) whose both halves this chunk made known: all but the chunk's last
        position, whose next token is not known yet. That hidden state waits in `pending_hidden`."""
        dev = self.device
        tok_rows, feats = [], []
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            end = s.num_cached + c  # target KV length after this chunk
            tok_rows.append(s.token_ids[s.num_draft_cached + 1: end])
            h = hidden[i, :c]
            feats.append(h if s.pending_hidden is None else torch.cat([s.pending_hidden[:1], h]))
        lens = [len(r) for r in tok_rows]
        P = max(max(lens), 1)
        H = hidden.shape[-1]
        hid = torch.zeros(len(seqs), P, H, dtype=hidden.dtype, device=dev)
        for i, f in enumerate(feats):
            hid[i, : lens[i]] = f[: lens[i]]
        if max(lens) > 0:
            start = torch.tensor([s.num_draft_cached for s in seqs], device=dev)
            catch_up(self.draft, self.target, self.draft_cache, padded(tok_rows, P).to(dev), hid,
                     torch.tensor(lens, device=dev), start, meta)
        for i, (s, c) in enumerate(zip(seqs, chunk_lens)):
            s.num_draft_cached += lens[i]
            s.pending_hidden = feats[i][lens[i]:][:1]  # h at the chunk's last position

    # ---- decode: one speculative step -----------------------------------------------------------------------
    def decode_inputs(self, seqs: list[Sequence], width: int | None = None) -> DecodeInputs:
        """Pack the sequences' host state into device tensors (the only host->device traffic of a step)."""
        dev = self.device
        P = self.lookahead
        cat_tokens, cat_hidden = [], []
        for s in seqs:
            if self.draft is not None:
                cat_tokens.append(s.token_ids[s.num_draft_cached + 1: s.num_cached + 1])
                h = s.pending_hidden
                cat_hidden.append(h if h.shape[0] == P else torch.cat([h, h.new_zeros(P - h.shape[0], h.shape[1])]))
        p = [s.params for s in seqs]
        return DecodeInputs(
            root_tokens=torch.tensor([s.token_ids[-1] for s in seqs], device=dev),
            num_cached=torch.tensor([s.num_cached for s in seqs], device=dev),
            num_draft_cached=torch.tensor([s.num_draft_cached for s in seqs], device=dev),
            block_tables=block_tables_of(seqs, width).to(dev),
            catchup_tokens=padded(cat_tokens, P).to(dev) if self.draft is not None else None,
            catchup_hidden=torch.stack(cat_hidden) if self.draft is not None else None,
            temperature=torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev),
            top_k=torch.tensor([x.top_k for x in p], dtype=torch.long, device=dev),
            top_p=torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev),
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev),
            max_context_len=max(s.num_cached for s in seqs),
        )

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[int]]:
        """One speculative step for all sequences (see `spec_step` for what each cache holds before and after).
        Returns (new tokens per sequence: accepted draft tokens + bonus, accepted draft tokens per sequence)."""
        if self.graphs is not None and self.graphs.can_run(seqs):
            out = self.graphs.run(seqs)
        else:
            out = spec_step(self.target, self.draft, self.tree, self.cache, self.draft_cache,
                            self.decode_inputs(seqs), self.block_size, self.use_triton, self.simulated_accept,
                            all_greedy(seqs))
        return self._apply(seqs, out)

    def _apply(self, seqs: list[Sequence], out: DecodeOutputs) -> tuple[list[list[int]], list[int]]:
        # the one host synchronisation of the step: accepted counts, path tokens and bonus in one transfer
        n = len(seqs)
        host = torch.cat([out.num_accepted[:n, None], out.path_tokens[:n], out.bonus[:n, None]], dim=1).tolist()
        m_host = [row[0] for row in host]
        tok_host = [row[1:-1] for row in host]
        bonus_host = [row[-1] for row in host]
        new_tokens = []
        for i, s in enumerate(seqs):
            m = m_host[i]
            new_tokens.append(tok_host[i][1: m + 1] + [bonus_host[i]])
            s.num_draft_cached = s.num_cached if self.draft is not None else 0
            s.num_cached += m + 1
            if out.accepted_hidden is not None:
                s.pending_hidden = out.accepted_hidden[i].clone()  # rows 0..m valid
        return new_tokens, m_host
