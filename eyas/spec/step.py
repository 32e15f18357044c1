"""The speculative step, on the device: draft -> verify -> accept -> commit.

`spec_step` reads only device tensors of fixed shapes (`DecodeInputs`) and makes no host synchronisation, so the
runner can call it directly or capture it whole in a CUDA graph per batch-size bucket. With no draft the tree is the
bare root and the step is plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.layers.attention import MetaBuilder, Stash, write_kv
from eyas.layers.sampler import logits_to_probs
from eyas.layers.topk import argmax
from eyas.spec.drafter import catch_up, causal_mask, expand_tree
from eyas.spec.dynamic_tree import DynamicTree, StepTree, expand_dynamic
from eyas.spec.tree import Tree
from eyas.spec.verifier import (accept_tree, accept_tree_greedy, accept_tree_logits, accept_tree_race, race_winners,
                                simulate_accept, simulate_replay)


# The step's index work around the draft's catch-up in two Triton launches (`eyas.kernels.spec_prologue`): the root
# token, the target and draft positions and the catch-up's mask in one, the root's feature row in the other, instead
# of ~9 small PyTorch kernels (session 39's profile: ~10 us of them before the root's head). Static trees with a
# draft on the Triton path. On since session 42 (real SmolLM2, MT-Bench 80 x 128, batch 1, three runs each way: the
# default tree's step 1.044 ms against 1.063, `chain:3`'s 0.778 against 0.791; at batch 8 1.539 against 1.554-1.578).
FUSED_PROLOGUE = True

# A sampled step's acceptance rounds and walk in one Triton launch (`eyas.kernels.accept_sampled`) instead of ~25
# PyTorch ops. On since session 60 (H100, `tools/diag/accept_cost.py`, graphed: the default tree's acceptance 0.020
# ms against 0.153 at batch 1, 0.068 against 0.237 at 16; SmolLM2 with its draft, MT-Bench 80 x 128 at T=1, the
# same tokens: the tree's step 1.037 ms against 1.181 at batch 1, 1.941 against 2.116 at 16, `chain:3`'s 0.781
# against 0.894 and 1.024 against 1.151).
FUSED_SAMPLED_ROUNDS = True

# Filtered steps (top-k, top-p, min-p) without the vocabulary's sort: one threshold per node found by radix selection
# (`eyas.kernels.filter_threshold`), then the acceptance from the logits as for unfiltered steps, instead of the
# filtered probabilities whole (`logits_to_probs`, which sorts). Ties at a filter's boundary then all stay (the sort
# keeps some). On since session 60 (H100, top-p 0.9 at T=1, SmolLM2 with its draft, MT-Bench 80 x 128, against the
# probabilities in the same call): plain decoding 0.497 ms a token against 0.649 at batch 1 and 0.808 against 1.130
# at 16; the default tree's step 1.303 ms against 1.805 at batch 1 and 2.856 against 8.432 at 16; `chain:3`'s
# 0.963 against 1.197 and 1.270 against 1.829.
SORT_FREE_FILTERS = True
# sampled steps accept by `accept_tree_race`: children iff they are the tokens plain decoding draws there (the race
# at each node), so seeded output is plain decoding's in any tree and batch (session 64; on an H100 its step cost the
# rounds' within 0.5%, 2% more for the default tree at batch 16: session 65); off: multi-round speculative sampling
# with the rounds' own draws (the two switches above choose among its paths)
COUPLED = True

# Not kept: the step's last write (`commit_features`) in one Triton launch, the features through the draft's `fuse`
# inside it (session 41, ff27ad5). It lost on the H200 in session 42 (with the prologue, two runs each way: the
# default tree's step 1.054 ms against 1.039, `chain:3`'s 0.778 against 0.774) and was removed after 8ff1daa.


def root_and_positions(root_tokens: torch.Tensor, n: torch.Tensor, depth: torch.Tensor):
    """node_tokens [B, N+1] with column 0 = root_tokens (the levels fill the rest) and the target positions of root
    and tree [B, N+1] = n[b] + depth[j]."""
    node_tokens = torch.empty(root_tokens.shape[0], depth.shape[0], dtype=torch.long, device=root_tokens.device)
    node_tokens[:, 0] = root_tokens
    return node_tokens, n[:, None] + depth.to(n.device)[None, :]


def root_row_reference(out: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The root's feature: out [B, P, H] (the catch-up's draft outputs) at row max(lens[b] - 1, 0), the last pair's
    -> [B, H]. The reference of `eyas.kernels.spec_prologue.root_row_triton`."""
    B, _, H = out.shape
    return out.gather(1, (lens - 1).clamp(min=0)[:, None, None].expand(B, 1, H))[:, 0]


def step_indices_reference(root_tokens: torch.Tensor, n: torch.Tensor, lens: torch.Tensor, depth: torch.Tensor,
                           P: int):
    """(node_tokens, positions, draft_positions [B, N+1], the catch-up's mask [B, P, P]) as `spec_step` computes them
    without `FUSED_PROLOGUE`. The reference of `eyas.kernels.spec_prologue.step_indices_triton`."""
    node_tokens, positions = root_and_positions(root_tokens, n, depth)
    return node_tokens, positions, positions - 1, causal_mask(lens, P)


def commit_features(draft, feats: torch.Tensor, node: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[slots[b], j] = draft.read_features(feats[b, node[b, j]]) for j < D1 = node.shape[1], node = the accepted
    path clamped at 0: the path's features (root first; rows past the accepted depth from the root's, never read), as
    the draft reads them at its next catch-up."""
    path_feats = feats.gather(1, node[:, :, None].expand(-1, -1, feats.shape[-1]))  # [B, D+1, F]
    dst[slots, :node.shape[1]] = draft.read_features(path_feats).to(dst.dtype)


@dataclass
class DecodeInputs:
    """One decode step's inputs for B sequences (device tensors; padded rows have num_cached 0, block table 0 and
    the scratch hidden slot). The runner packs them all into one buffer (`eyas.engine.runner.StepPacker`): these
    tensors are views of it, so a step's host->device traffic is one copy."""
    root_tokens: torch.Tensor  # [B] the last committed token x_n
    num_cached: torch.Tensor  # [B] n: target KV entries (positions 0..n-1)
    num_draft_cached: torch.Tensor  # [B] draft KV entries
    block_tables: torch.Tensor  # [B, W]
    commit_slots: torch.Tensor  # [B, P] flat KV slots of positions n .. n+P-1 (what a step may commit)
    catchup_tokens: torch.Tensor | None  # [B, P] tokens x_{t+1} for t = num_draft_cached .. n-1 (padded)
    catchup_positions: torch.Tensor | None  # [B, P] their positions t (0 past catchup_lens)
    catchup_slots: torch.Tensor | None  # [B, P] their flat slots in the draft cache (-1 past catchup_lens)
    catchup_lens: torch.Tensor | None  # [B] n - num_draft_cached: how many pairs the draft catches up on
    slots: torch.Tensor  # [B] rows of the draft's hidden-state buffer (see `spec_step`)
    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B]
    max_context_len: int  # host-side bound on num_cached (the reference attention's gather width)
    # n-gram speculation (no draft model, `eyas.spec.ngram`): [B, P] the chain's proposed tokens (first N columns)
    proposed: torch.Tensor | None = None


@dataclass
class DecodeOutputs:
    path_tokens: torch.Tensor  # [B, D+1] tokens of the accepted path, root first (valid up to num_accepted)
    num_accepted: torch.Tensor  # [B] draft tokens accepted
    bonus: torch.Tensor  # [B] the token sampled after the accepted path
    packed: torch.Tensor  # [B, D+3]: num_accepted, path_tokens, bonus (what the host reads, in one transfer)
    # with `logprobs` asked: the committed tokens' log-probabilities [B, D+1] (accepted draft
    # tokens, then the bonus; valid up to num_accepted + 1), the top k's [B, D+1, k] and their ids
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class Drafted:
    """A step's state after its draft phase (`draft_phase`): the tree it proposes and what the verify pass reads."""
    tree: Tree | StepTree  # a dynamic tree: this step's trees (`StepTree`: per-row parents and masks)
    node_tokens: torch.Tensor  # [B, N+1] root and tree tokens
    positions: torch.Tensor  # [B, N+1] their target positions
    meta: MetaBuilder


@dataclass
class Verified:
    """A step's state after its verify pass (`verify_phase`)."""
    logits: torch.Tensor  # [B, N+1, V] the target's logits at every node (masked in place under guided decoding)
    feats: torch.Tensor  # [B, N+1, F] what the draft reads of the target's states (`commit_features`)
    stash: Stash | None  # every layer's K/V of root + tree (None for the bare root: its K/V are in the cache)


def spec_step(target, draft, tree: Tree | DynamicTree, cache, draft_cache, inp: DecodeInputs, block_size: int,
              use_triton: bool = False, simulated_accept: torch.Tensor | None = None,
              all_greedy: bool = False, draft_hidden: torch.Tensor | None = None, guide=None,
              logprobs: int | None = None, penalties=None, filters: bool = True) -> DecodeOutputs:
    """One speculative step for every sequence: `draft_phase`, `verify_phase`, `accept_phase`.

    Before: the target KV holds positions 0..n-1 of each sequence, the last committed token x_n has none; the draft
    KV holds 0..d-1 and the committed pairs (x_{t+1}, h_t), t = d..n-1, it has not read are `catchup_tokens` and
    rows 0..n-d-1 of `draft_hidden[slots]` ([num_slots, D+1, H], one row per running sequence, kept on the device).
    `all_greedy`: every request has temperature 0, so acceptance needs only the target's argmax (no sort over the
    vocabulary); the result is the same as the general path's. `filters=False`: no sampled request asks for top-k,
    top-p or min-p, so the sampler's distribution is a softmax, accepted from the logits without a sort or a
    normalised copy (`accept_tree_logits`).
    `simulated_accept` (benchmarks of random-weight models): per-depth acceptance rates (float [D]) or a real
    draft's recorded rank paths (integer [T, R], `simulate_replay`) replace the real acceptance.

    After: the target KV holds 0..n+m (root and the m accepted draft tokens; nothing of rejected branches), the draft
    KV holds 0..n-1, the outputs give the new tokens (accepted path + bonus), and `draft_hidden[slots]` holds the
    target's hidden states along the accepted path, as the draft reads them (`draft.read_features`: the final hidden
    state for an EAGLE-1 draft, the fused multi-layer features for a draft with feature layers): the draft's next
    catch-up pairs.
    `guide` (guided decoding, an `eyas.spec.grammar.TreeGuide`): the target's logits at every node are masked by the
    grammar state that node's path reaches, before acceptance; the step then reads the tree's tokens back to the
    host once, between its draft and its acceptance. Run eagerly, that is this function; graphed
    (`eyas.engine.cuda_graph.GraphedStep.launch_guided`), each phase is a graph and the host computes the masks
    while the verify pass runs.
    With the bare-root tree (plain decoding; with a draft, a dispatcher's choice for large batches) the root's K/V
    are written straight to the cache, and its attention is one prefix pass that includes it (no suffix pass).
    `logprobs` (k, when a request asks for log-probabilities): the outputs also hold the committed tokens' and the top
    k's (`eyas.layers.logprobs`). `penalties` (`eyas.layers.penalties.Penalties`, when a request asks for repetition
    penalties): every node's logits are penalised by the committed tokens and its own path's, before acceptance, and
    the draft proposes from logits penalised so too.
    """
    allowed = None
    if guide is not None and draft is not None:  # the root's children from the tokens the grammar allows next
        B = inp.root_tokens.shape[0]
        allowed = guide.root_masks(torch.empty((B, guide.words), dtype=torch.int32)).to(inp.root_tokens.device)
    d = draft_phase(target, draft, tree, draft_cache, inp, block_size, use_triton, simulated_accept, draft_hidden,
                    allowed, penalties)
    if guide is not None:  # guided decoding: the tree's tokens go to the host while the target verifies them
        guide.read(d.node_tokens, d.tree.parents)
    v = verify_phase(target, draft, d, cache, inp)
    if guide is not None:  # each node's logits restricted to what the grammar allows after its path
        guide.apply(v.logits)
    if penalties is not None:  # ... and penalised by the tokens before it, its path's included
        penalties.apply_to_tree(v.logits, d.node_tokens, d.tree.ancestor_mask)
    return accept_phase(draft, d, v, cache, inp, use_triton, simulated_accept, all_greedy, draft_hidden, logprobs,
                        filters)


# The draft proposes from logits penalised as the target's will be (`expand_tree`'s `penalties`), when a request asks
# for repetition penalties. Off, it proposes as if there were none, and accepts less of what the penalised target
# says (the output is the same: the draft only proposes).
PENALISE_DRAFT = True


def draft_phase(target, draft, tree: Tree | DynamicTree, draft_cache, inp: DecodeInputs, block_size: int,
                use_triton: bool = False, simulated_accept: torch.Tensor | None = None,
                draft_hidden: torch.Tensor | None = None, root_allowed: torch.Tensor | None = None,
                penalties=None) -> Drafted:
    """The step's draft: it reads the committed history it has not read (catch-up), then expands the tree level by
    level. Without a draft, the tree is the bare root. `root_allowed` [B, words] (guided decoding: each row's
    grammar mask after its committed tokens): the root's children are proposed among the tokens it allows.
    `penalties`: each node's children are proposed from penalised draft logits (`expand_tree`; not when
    PENALISE_DRAFT is off)."""
    penalties = penalties if PENALISE_DRAFT else None
    dynamic = isinstance(tree, DynamicTree)
    if dynamic and (draft is None or simulated_accept is not None):
        raise ValueError(f"{tree.name}: a dynamic tree needs a draft, and its acceptance cannot be replayed")
    B = inp.root_tokens.shape[0]
    device = inp.root_tokens.device
    N1 = tree.num_nodes + 1
    n = inp.num_cached
    fused = (FUSED_PROLOGUE and use_triton and draft is not None and not dynamic and tree.num_nodes > 0
             and inp.catchup_tokens is not None)
    catchup_mask = draft_positions = None
    if fused:  # the same four in one launch
        from eyas.kernels.spec_prologue import step_indices_triton
        node_tokens, positions, draft_positions, catchup_mask = step_indices_triton(
            inp.root_tokens, n, inp.catchup_lens, tree.depth.to(device), inp.catchup_tokens.shape[1])
    elif not dynamic:
        node_tokens, positions = root_and_positions(inp.root_tokens, n, tree.depth.to(device))

    meta = MetaBuilder(inp.block_tables, block_size, inp.max_context_len, use_triton)

    # draft: read the committed history, then expand the tree level by level (a bare root, which a tree dispatcher
    # picks for large batches, only reads: the draft stays in step for the next speculative step); a dynamic tree
    # is grown for each sequence, and `tree` becomes this step's trees
    if draft is None and inp.proposed is not None and tree.num_nodes:  # n-gram proposals, made on the host: a chain
        node_tokens[:, 1:] = inp.proposed[:, :tree.num_nodes]
    if draft is not None:
        lens = inp.catchup_lens
        out = catch_up(draft, target, draft_cache, inp.catchup_tokens, draft_hidden, lens,
                       inp.num_draft_cached, meta, inp.catchup_positions, inp.catchup_slots, hidden_rows=inp.slots,
                       mask=catchup_mask)
        if fused:  # the root's feature straight into the levels' feature buffer, row 0
            from eyas.kernels.spec_prologue import root_row_triton
            node_h = torch.empty(B, N1, out.shape[-1], dtype=out.dtype, device=device)
            expand_tree(draft, target, draft_cache, tree, root_row_triton(out, lens, node_h[:, 0]), n, node_tokens,
                        meta, draft_positions, node_h=node_h, root_allowed=root_allowed, penalties=penalties)
        elif tree.num_nodes:  # the root's feature: the last pair's output (n > d always: the root's own pair)
            root_h = root_row_reference(out, lens)
            if dynamic:
                node_tokens, tree = expand_dynamic(draft, target, draft_cache, tree, root_h, inp.root_tokens, n,
                                                   meta, root_allowed, penalties)
                positions = n[:, None] + tree.depth
            else:
                expand_tree(draft, target, draft_cache, tree, root_h, n, node_tokens, meta, positions - 1,
                            root_allowed=root_allowed, penalties=penalties)
    return Drafted(tree, node_tokens, positions, meta)


def verify_phase(target, draft, d: Drafted, cache, inp: DecodeInputs) -> Verified:
    """The verify pass: one target forward over root + tree; split tree attention; K/V stashed, not cached (a bare
    root, which is always accepted, writes its K/V to the cache directly)."""
    tree, n = d.tree, inp.num_cached
    B, N1 = d.node_tokens.shape
    mask = tree.ancestor_mask
    if not isinstance(tree, StepTree):  # a static tree's, the same for every row
        mask = mask.to(n.device)[None].expand(B, N1, N1)
    stash = None
    if tree.num_nodes:
        stash = Stash.like(cache, B, N1)  # every layer's K/V of root + tree, node by node
        vmeta = d.meta(n, mask, stash=stash)
    else:
        # plain decoding: the root's K/V go straight to the cache, and one prefix pass over n + 1 entries (the root
        # included) is its whole attention
        vmeta = d.meta(n + 1, mask, max_context_len=inp.max_context_len + 1, prefix_includes_new=True,
                       slot_mapping=inp.commit_slots[:, :1])
    feature_layers = getattr(draft, "feature_layers", None)
    if feature_layers is None:  # EAGLE-1 (or no draft): the draft reads the final hidden state itself
        hidden = feats = target(d.node_tokens, d.positions, vmeta, cache)
    else:  # EAGLE-3-style draft: it reads lower layers' features too (fused to H at commit, `read_features`)
        hidden, feats = target(d.node_tokens, d.positions, vmeta, cache, feature_layers=feature_layers)
    logits = target.compute_logits(hidden, dtype=None)  # argmaxes need no float32 copy; the sampler upcasts
    return Verified(logits, feats, stash)


def accept_phase(draft, d: Drafted, v: Verified, cache, inp: DecodeInputs, use_triton: bool = False,
                 simulated_accept: torch.Tensor | None = None, all_greedy: bool = False,
                 draft_hidden: torch.Tensor | None = None, logprobs: int | None = None,
                 filters: bool = True) -> DecodeOutputs:
    """Acceptance (the longest accepted path and a bonus token: greedy or lossless speculative sampling), then the
    commit of the path's K/V and features, and with `logprobs` (k) the committed tokens' log-probabilities."""
    tree, node_tokens, logits, n = d.tree, d.node_tokens, v.logits, inp.num_cached
    B, N1, V = logits.shape
    device = logits.device
    packed = None  # (num_accepted, path tokens, bonus): what the host reads; the Triton acceptance writes it itself
    if simulated_accept is not None and simulated_accept.is_floating_point():  # benchmarks of random weights only:
        path, num_accepted, bonus = simulate_accept(node_tokens, tree, simulated_accept, inp.seeds, n,  # rates by
                                                    argmax(logits))  # depth
    elif simulated_accept is not None:  # ... or a real draft's recorded rank paths, replayed (as greedy acceptance
        if use_triton:                   # costs, one launch on CUDA)
            from eyas.kernels.accept_greedy import replay_accept_triton
            path, num_accepted, bonus, packed = replay_accept_triton(simulated_accept, inp.seeds, n, argmax(logits),
                                                                     node_tokens, tree)
        else:
            path, num_accepted, bonus = simulate_replay(node_tokens, tree, simulated_accept, inp.seeds, n,
                                                        argmax(logits))
    elif all_greedy and not tree.num_nodes:  # plain greedy decoding: nothing to accept, the bonus is the argmax
        path = torch.zeros(B, 1, dtype=torch.long, device=device)
        num_accepted, bonus = path[:, 0], argmax(logits[:, 0])
    elif all_greedy:  # a child is accepted iff it is the target's argmax (on CUDA: one Triton launch)
        if use_triton:
            from eyas.kernels.accept_greedy import accept_tree_greedy_triton
            path, num_accepted, bonus, packed = accept_tree_greedy_triton(argmax(logits), node_tokens, tree)
        else:
            path, num_accepted, bonus = accept_tree_greedy(argmax(logits), node_tokens, tree)
    elif COUPLED and use_triton:  # sampled: `accept_tree_race`, its greedy walk in one Triton launch
        from eyas.kernels.accept_greedy import accept_tree_greedy_triton
        winners = race_winners(logits, inp.temperature, tree, inp.seeds, n, True,
                               (inp.top_k, inp.top_p, inp.min_p) if filters else None)
        path, num_accepted, bonus, packed = accept_tree_greedy_triton(winners, node_tokens, tree)
    elif COUPLED:  # sampled: children accepted iff they are the tokens plain decoding draws there
        path, num_accepted, bonus = accept_tree_race(logits, inp.temperature, node_tokens, tree, inp.seeds, n, False,
                                                     (inp.top_k, inp.top_p, inp.min_p) if filters else None)
    elif not filters and use_triton and FUSED_SAMPLED_ROUNDS:  # sampled, in five launches
        from eyas.kernels.accept_sampled import accept_tree_logits_triton
        path, num_accepted, bonus, packed = accept_tree_logits_triton(logits, inp.temperature, node_tokens, tree,
                                                                      inp.seeds, n)
    elif not filters:  # sampled: the softmax's statistics, the children's probabilities and one race a sequence
        path, num_accepted, bonus = accept_tree_logits(logits, inp.temperature, node_tokens, tree, inp.seeds, n,
                                                       use_triton)
    elif use_triton and SORT_FREE_FILTERS:  # top-k, top-p or min-p as one threshold a node, no sort
        path, num_accepted, bonus = accept_tree_logits(logits, inp.temperature, node_tokens, tree, inp.seeds, n,
                                                       True, filters=(inp.top_k, inp.top_p, inp.min_p))
    else:  # top-k, top-p or min-p: the filtered distributions, whole (the filters sort the vocabulary)
        probs = logits_to_probs(logits.view(B * N1, V), inp.temperature.repeat_interleave(N1),
                                inp.top_k.repeat_interleave(N1), inp.top_p.repeat_interleave(N1),
                                inp.min_p.repeat_interleave(N1), filters).view(B, N1, V)
        path, num_accepted, bonus = accept_tree(probs, node_tokens, tree, inp.seeds, n, use_triton,
                                                race=(logits, inp.temperature))

    # commit: the accepted path's K/V go to positions n..n+m, every layer at once (a bare root's are there already)
    D1 = path.shape[1]
    node = path.clamp(min=0)  # the accepted path's rows
    stash = v.stash
    if stash is not None:  # the path is -1 past the accepted depth: nothing is written there
        if use_triton:
            from eyas.kernels import commit_tree_kv_triton
            commit_tree_kv_triton(cache.k, cache.v, stash.k, stash.v, path, inp.commit_slots[:, :D1])
        else:
            slots = torch.where(path >= 0, inp.commit_slots[:, :D1], -1)
            rows = torch.arange(B, device=device)[:, None]
            for layer in range(stash.k.shape[0]):
                write_kv(cache.k[layer], cache.v[layer], stash.k[layer][rows, node], stash.v[layer][rows, node],
                         slots)
    if draft is not None:
        # rows 0..m valid; a dispatcher's shallower trees fill only the first D+1 of the buffer's rows
        commit_features(draft, v.feats, node, draft_hidden, inp.slots)
    if packed is None:
        path_tokens = node_tokens.gather(1, node)
        packed = torch.cat([num_accepted[:, None], path_tokens, bonus[:, None]], dim=1)
    else:
        path_tokens = packed[:, 1: D1 + 1]
    lps = None
    if logprobs is not None:  # committed token j (the path's token at depth j + 1, or the bonus at j = m) was
        # verified against the logits of the path's node at depth j
        committed = torch.cat([path_tokens[:, 1:], bonus[:, None]], dim=1)
        committed.scatter_(1, num_accepted[:, None].long(), bonus[:, None])
        from eyas.layers.logprobs import token_logprobs
        lps = token_logprobs(logits.gather(1, node[:, :, None].expand(B, D1, V)), committed, logprobs)
    return DecodeOutputs(path_tokens, num_accepted, bonus, packed, lps)
