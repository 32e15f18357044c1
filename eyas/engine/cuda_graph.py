"""CUDA graphs of the whole speculative step, one per (batch-size bucket, sampling mode, tree, context bucket); a tree
dispatcher (`eyas.spec.dispatch`) picks the tree by batch size.

The graph replays `spec_step` (draft catch-up, every tree level, verification, acceptance and sampling, and the KV
commit) from static input buffers: the device side of the runner's packed step inputs (`StepPacker`), so filling them
is one copy. A step pads its batch up to the bucket: padded rows have block tables of zeros, so everything they write
lands in the scratch block 0 (and in the scratch slot of the draft's hidden states), and their outputs are ignored.
The reference beside this fast path is `spec_step` run eagerly; tests/test_cuda_graph.py holds the two equal.
Beside each step graph a small graph of `eyas.spec.carry.carry_inputs` turns the static outputs of one replay into
the static inputs of the next, for overlapped decoding (the engine enqueues a successor before reading a step back).
A guided step (grammar masks from the host between draft and acceptance) is three graphs, one per phase of the step
(`launch_guided`); its reference is `spec_step` with the same guide, run eagerly. A step in which a request asks for
log-probabilities or applies penalties replays a graph of its own kind (`launch_extras`): it writes the top
MAX_LOGPROBS log-probabilities of every committed token to static outputs, and reads the penalties' counts and
coefficients from static inputs; its reference is `spec_step` with the same arguments, run eagerly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading

import torch

from eyas.layers.penalties import Penalties
from eyas.layers.sampler import SAMPLING_MODES, sampling_mode
from eyas.sampling_params import MAX_LOGPROBS
from eyas.spec.step import DecodeInputs, DecodeOutputs, accept_phase, draft_phase, spec_step, verify_phase

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Context buckets (tokens), for the Triton attention only. A graph bakes in the attention's split count, chosen for
# the longest context the graph may see (`max_context_len` of its static inputs); sized for max_model_len, a chat's
# few hundred tokens leave most splits idle (session 33: at SmolLM2's 8192 the default tree's step 7-9% slower and
# plain decoding's 5-8% than at the benchmark's width). So each step graph exists per bucket too, and a step takes
# the smallest bucket above its sequences' longest context; a context past the bucket is still exact (the kernels
# read the lengths on the device; the bucket only steers the split count). The reference attention gathers
# max_context_len keys, so without Triton there is one bucket, the block table's width.
CONTEXT_BUCKETS = (512, 2048)
# eager steps run before each capture (Triton's compiles, the allocator's blocks). A server's startup is mostly these
# (session 62: 171 graphs of the shipped dispatcher in 83.8 s on a fresh machine). One is enough: with 1, the graph
# tests that hold replays to eager steps pass (tests/test_cuda_graph.py -k "not smollm2", H100), and the 171 graphs
# take 9.4 s against 14.7 s with 2, kernels compiled (session 64, tools/device/s64_capture_warmups.sh)
CAPTURE_WARMUPS = 1
# the extras graphs `capture_all` can capture ahead (`eyas serve --capture-extras`): (log-probabilities, penalties'
# kind) of `launch_extras`'s keys, by name
EXTRAS_KINDS = {"logprobs": (True, 0), "penalties": (False, 1), "logprobs+penalties": (True, 1)}


_gc_lock = threading.Lock()
_gc_holds = [0, False]  # captures under way in this process, and whether the collector was on before the first


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool):
    """The capture of `graph` into `pool` (every decode and prefill capture goes through here), in the thread-local
    error mode: graphs are captured when a step first needs them, and a disaggregated engine's prefill thread
    (`eyas.engine.disagg`) may then be working on the same GPU; its synchronisations would invalidate a capture in
    the global mode (session 50's device call: a guided graph's capture failed so). This thread's own unsafe calls
    still fail the capture, so the cycle collector is off while any capture is under way (torch's capture no longer
    collects first): a collection in the middle of one would free a dropped engine's graphs, events and pinned
    buffers there (engines are cycles: runner <-> graphs). Sessions 62 and 65 saw captures invalidated so in
    tests/test_cuda_graph.py's overlapped test, which drops a graphed engine just before the next one captures.
    Session 67's H100, the graph files at `pytest -n 4`: with the collector off, 17 runs of 17 passed; with it left
    on during captures, 2 of 5 failed so (`tools/device/s66_capture_check.sh`)."""
    with _gc_lock:
        if _gc_holds[0] == 0:
            _gc_holds[1] = gc.isenabled()
            gc.disable()
        _gc_holds[0] += 1
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        with _gc_lock:
            _gc_holds[0] -= 1
            if _gc_holds[0] == 0 and _gc_holds[1]:
                gc.enable()


def context_buckets(full: int) -> tuple[int, ...]:
    """The context buckets of a block table `full` tokens wide: CONTEXT_BUCKETS below it, then `full`."""
    return tuple(c for c in CONTEXT_BUCKETS if c < full) + (full,)


def context_bucket(need: int, full: int) -> int:
    """The smallest of `context_buckets(full)` >= `need` (`full` where none is)."""
    return next((c for c in context_buckets(full) if c >= need), full)


class GraphedStep:
    def __init__(self, runner, max_model_len: int):
        self.runner = runner
        self.width = runner.width  # block-table width covering any sequence (max_model_len + lookahead + 1 slots)
        full = self.width * runner.block_size
        self.context_buckets = context_buckets(full) if runner.use_triton else (full,)
        # one graph per (bucket, sampling mode (`eyas.layers.sampler.sampling_mode`), tree: a dispatcher picks the
        # tree by batch size, context bucket)
        self.graphs: dict[tuple[int, str, str, int], tuple[torch.cuda.CUDAGraph, DecodeInputs, DecodeOutputs]] = {}
        self.carries: dict[tuple[int, str, str, int], torch.cuda.CUDAGraph] = {}  # overlapped steps' input carries
        # guided steps' (`launch_guided`), keyed as the graphs plus (log-probabilities, penalties)
        self.guided: dict[tuple[int, str, str, int, bool, bool], GuidedGraphs] = {}
        # steps that report log-probabilities or apply penalties (`launch_extras`), keyed so too
        self.extras: dict[tuple[int, str, str, int, bool, bool], ExtrasGraph] = {}
        # their penalties' static buffers, per batch bucket and kind (`Penalties.kind`)
        self._extras_penalties: dict[tuple[int, int], Penalties] = {}
        self.pool = None

    def bucket(self, n: int) -> int | None:
        return next((b for b in BUCKETS if b >= n), None)

    def can_run(self, seqs) -> bool:
        return self.bucket(len(seqs)) is not None and all(len(s.block_table) <= self.width for s in seqs)

    def _static_inputs(self, B: int, context: int) -> DecodeInputs:
        """The graph's static inputs: the device views of the runner's B-row packer (filled by one copy per step;
        the graphs of every context bucket share them), with max_context_len fixed at the context bucket (the
        reference attention's gather width: the widest block table)."""
        r = self.runner
        r.decode_inputs([], B)  # all rows padding: the warm-up and capture runs write only to the scratch block/slot
        return dataclasses.replace(r.packer(B).inputs, max_context_len=context)

    def _step(self, inp: DecodeInputs, mode: str, tree, logprobs: int | None = None,
              penalties: Penalties | None = None) -> DecodeOutputs:
        r = self.runner
        return spec_step(r.target, r.draft_for(tree), tree, r.cache, r.draft_cache, inp, r.block_size, r.use_triton,
                         r.simulated_accept, mode == "greedy", r.draft_hidden, None, logprobs, penalties,
                         filters=mode == "filtered")

    def _capturing(self, graph: torch.cuda.CUDAGraph):
        """The capture of `graph` into the graphs' shared pool (`capturing`)."""
        return capturing(graph, self.pool)

    def _capture(self, key: tuple[int, str, str, int], tree):
        B, mode, _, context = key
        static = self._static_inputs(B, context)
        graph, out = self._capture_step(static, mode, tree)
        self.graphs[key] = (graph, static, out)
        self.carries[key] = self._capture_carry(static, out)  # for overlapped decoding

    def _capture_step(self, static: DecodeInputs, mode: str, tree, logprobs: int | None = None,
                      penalties: Penalties | None = None) -> tuple[torch.cuda.CUDAGraph, DecodeOutputs]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(CAPTURE_WARMUPS):  # compile the Triton kernels and warm the allocator outside the capture
                self._step(static, mode, tree, logprobs, penalties)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self._capturing(graph):
            out = self._step(static, mode, tree, logprobs, penalties)
        self.pool = graph.pool()
        return graph, out

    @torch.inference_mode()
    def capture_all(self, max_batch: int, modes: tuple[str, ...] = SAMPLING_MODES,
                    extras: tuple[tuple[bool, int], ...] = (), progress=None) -> int:
        """Capture, ahead of time, every graph a batch of up to `max_batch` sequences can need: one per bucket (as
        sequences finish, a batch shrinks through the smaller buckets), per tree the dispatcher picks inside that
        bucket (at the temperatures of its bands, for sampled modes), per sampling mode (`modes`), per context
        bucket. Otherwise the first step at each new bucket pays for a capture (`CAPTURE_WARMUPS` eager steps plus the
        capture itself) in the middle of decoding. `extras`: (log-probabilities, penalties' kind) pairs whose
        `launch_extras` graphs are captured ahead too, for the same keys (`eyas serve --capture-extras`; otherwise
        the first such step at a key captures them, 0.2-0.8 s in the request's path on an H100, session 64).
        `progress`: a tqdm bar, whose total grows by the graphs to capture and which advances as they are.
        Returns how many graphs were captured."""
        plan = self._plan(max_batch, modes, extras)
        if progress is not None:
            progress.total = (progress.total or 0) + sum(self._missing(*item) for item in plan)
            progress.refresh()
        new = 0
        for B, mode, tree, extra in plan:
            n = (self._capture_buckets(B, mode, tree) if extra is None
                 else self._capture_extras((B, mode, tree.name, None, *extra), tree))
            new += n
            if progress is not None:
                progress.update(n)
        return new

    def _plan(self, max_batch: int, modes: tuple[str, ...], extras: tuple[tuple[bool, int], ...]) -> list[tuple]:
        """`capture_all`'s work in its order: (batch bucket, sampling mode, tree, None for the step graphs or an
        extras pair for their twins), each for every context bucket."""
        top = self.bucket(min(max_batch, BUCKETS[-1]))
        plan, lo = [], 1
        for b in BUCKETS:
            if b > top:
                break
            temps = getattr(self.runner.tree, "temperatures", [0.0])  # a greedy step takes the first band only
            for m in modes:
                trees = {}
                for n in range(lo, b + 1):
                    for temp in (temps[:1] if m == "greedy" else temps):
                        t = self.runner.tree_for(n, temp)
                        trees[t.name] = t
                if self.runner.proposer is not None:  # n-gram steps where no sequence has a proposal: plain steps
                    trees[self.runner.plain_tree.name] = self.runner.plain_tree
                bare = self.runner.bare_tree  # plain steps without the draft, of requests that never speculate
                if bare is not None and (m != "greedy" or self.runner.plain_from <= 0):
                    trees[bare.name] = bare
                for t in trees.values():
                    plan.append((b, m, t, None))
                    plan += [(b, m, t, extra) for extra in extras]
            lo = b + 1
        return plan

    def _keys(self, B: int, mode: str, name: str, extra: tuple[bool, int] | None = None) -> tuple[dict, list[tuple]]:
        """The keys of (B, mode, tree `name`) in every context bucket, extended by `extra` (log-probabilities,
        penalties' kind) for the extras twins, and the dictionary that holds their graphs."""
        if extra is None:
            return self.graphs, [(B, mode, name, c) for c in self.context_buckets]
        return self.extras, [(B, mode, name, c, *extra) for c in self.context_buckets]

    def _missing(self, B: int, mode: str, tree, extra: tuple[bool, int] | None) -> int:
        """How many graphs of a `_plan` item are not captured yet."""
        store, keys = self._keys(B, mode, tree.name, extra)
        return sum(k not in store for k in keys)

    def _capture_buckets(self, B: int, mode: str, tree) -> int:
        """Capture the graphs of every context bucket of (B, mode, tree) not captured yet; returns how many. They
        are captured together: a capture pads the static inputs, which an overlapped successor (its inputs carried,
        its tables refreshed) must find as they are, whichever bucket it moves to."""
        new = 0
        for k in self._keys(B, mode, tree.name)[1]:
            if k not in self.graphs:
                self._capture(k, tree)
                new += 1
        return new

    def _key(self, seqs, tree) -> tuple[int, str, str, int]:
        """The graph of a step of `tree` for `seqs`: (batch bucket, sampling mode, tree, context bucket)."""
        r = self.runner
        context = r.context_bound(seqs) if r.use_triton else self.context_buckets[-1]
        return self.bucket(len(seqs)), sampling_mode([s.params for s in seqs]), tree.name, context

    @torch.inference_mode()
    def launch(self, seqs, tree, carried_from: tuple | None = None) -> tuple[tuple, DecodeOutputs]:
        """Replay the step of `tree` for `seqs` (inputs packed from the host), or, `carried_from` (the key of the
        graph replayed last for them), for the step after that one (overlapped decoding: the inputs are carried on
        the device by a small captured graph of `eyas.spec.carry.carry_inputs` from that step's outputs; the
        context may have crossed into the next bucket's graph, which reads the same static inputs). Returns (the
        graph's key: (bucket, sampling mode, tree, context bucket), its static outputs)."""
        key = self._key(seqs, tree)
        if carried_from is not None:
            if carried_from[:3] != key[:3]:
                raise ValueError(f"a carried step must replay the graph of the same batch and tree: {carried_from} "
                                 f"then {key}")
            graph, static, out = self.graphs[key]  # captured with the step before's (below)
            self.carries[carried_from].replay()
        else:
            self._capture_buckets(key[0], key[1], tree)
            graph, static, out = self.graphs[key]
            self.runner.decode_inputs(seqs, key[0])  # one host->device copy into the static buffers
        graph.replay()
        return key, out

    @torch.inference_mode()
    def launch_extras(self, seqs, tree, logprobs: int | None, penalties: Penalties | None,
                      carried_from: tuple | None = None) -> tuple[tuple, DecodeOutputs]:
        """Replay a step that reports log-probabilities (`logprobs`, any k: the graph writes the top MAX_LOGPROBS of
        each committed token, and each request keeps its own k) or applies `penalties` (copied into the graph's
        static buffers, its padding rows neutral). `carried_from` (the key replayed last for the same sequences):
        overlapped decoding, the inputs carried on the device as `launch` carries them (the penalties' counts,
        `eyas.layers.penalties.PenaltyState`, already hold that step's tokens). The graphs of every context bucket
        of a key are captured together the first time it is met, each with its carry. Returns (the key: the
        graphs' plus (log-probabilities, penalties), the static outputs)."""
        key = self._key(seqs, tree) + (logprobs is not None, 0 if penalties is None else penalties.kind)
        if carried_from is not None:
            if carried_from[:3] != key[:3] or carried_from[4:] != key[4:]:
                raise ValueError(f"a carried step must replay the graph of the same batch, tree and extras: "
                                 f"{carried_from} then {key}")
            self.extras[carried_from].carry.replay()
        else:
            self._capture_extras(key, tree)
            self.runner.decode_inputs(seqs, key[0])
        g = self.extras[key]
        if penalties is not None:
            g.penalties.fill(penalties)
        g.graph.replay()
        return key, g.out

    def _capture_extras(self, key: tuple, tree) -> int:
        """The extras graphs of `key` in every context bucket (captured together, as `_capture_buckets` does), each
        with its carry; the penalties' static buffers are shared by the graphs of one batch bucket. Returns how many
        were captured."""
        B, mode, name, _, with_logprobs, with_penalties = key
        new = 0
        for k in self._keys(B, mode, name, (with_logprobs, with_penalties))[1]:
            if k in self.extras:
                continue
            static = self._static_inputs(B, k[3])
            pen = None
            if with_penalties:  # 2: with bad words of several tokens (`Penalties.kind`)
                pen = self._extras_penalties.get((B, with_penalties))
                if pen is None:
                    pen = self._extras_penalties[B, with_penalties] = Penalties.neutral(
                        B, self.runner.target.config.vocab_size, static.root_tokens.device, words=with_penalties == 2)
            graph, out = self._capture_step(static, mode, tree, MAX_LOGPROBS if with_logprobs else None, pen)
            self.extras[k] = ExtrasGraph(graph, pen, out, self._capture_carry(static, out))
            new += 1
        return new

    @torch.inference_mode()
    def launch_guided(self, seqs, tree, guide, logprobs: int | None = None, penalties: Penalties | None = None
                      ) -> tuple[tuple, DecodeOutputs]:
        """Replay a guided step (`guide`: an `eyas.spec.grammar.TreeGuide`) as three graphs: the draft (its root's
        children among the tokens each row's grammar allows next, from a static mask buffer); the verify
        pass, enqueued behind the copy of the tree's tokens to the host; then, once the host has computed every
        node's grammar mask from those tokens (while the verify pass runs) and sent the masks to a static buffer,
        masking, acceptance and commit. One host synchronisation in the middle of the step (the tokens), none after
        the masks are sent. Returns (the key: (bucket, sampling mode, tree, context bucket), the static outputs). The
        graphs are captured the first time a key is met (guided steps are never overlapped, so the context buckets
        need not be captured together). With `logprobs` or `penalties`, the accept graph also does what
        `launch_extras`'s does, the penalties after the masks as in `spec_step`; they are part of the key."""
        r = self.runner
        key = self._key(seqs, tree) + (logprobs is not None, 0 if penalties is None else penalties.kind)
        if key not in self.guided:
            self._capture_guided(key, tree, guide.words)
        g = self.guided[key]
        r.decode_inputs(seqs, key[0])
        if penalties is not None:
            g.penalties.fill(penalties)
        if g.root_masks is not None:  # the draft proposes the root's children among the tokens the grammar allows
            g.root_masks.copy_(guide.root_masks(g.root_masks_host), non_blocking=True)
        g.draft.replay()
        g.tokens_host.copy_(g.drafted.node_tokens, non_blocking=True)
        if g.parents_host.ndim == 2:  # a dynamic tree's, drafted this step
            g.parents_host.copy_(g.drafted.tree.parents, non_blocking=True)
        g.read.record()
        g.verify.replay()
        g.read.synchronize()
        guide.masks(g.tokens_host.numpy(), g.parents_host.numpy(), g.masks_host)
        g.masks.copy_(g.masks_host, non_blocking=True)
        g.accept.replay()
        return key, g.out

    def _capture_guided(self, key: tuple[int, str, str, int, bool, bool], tree, words: int) -> None:
        B, mode, _, context, with_logprobs, with_penalties = key
        r = self.runner
        static = self._static_inputs(B, context)
        device = static.root_tokens.device
        pen = Penalties.neutral(B, r.target.config.vocab_size, device, words=with_penalties == 2) \
            if with_penalties else None
        root_masks = None if r.draft_for(tree) is None else torch.full((B, words), -1, dtype=torch.int32, device=device)
        # every node's mask ([B, N1, words]: root and the N tree tokens, a dynamic tree's too); all allowed to warm up
        masks = torch.full((B, tree.num_nodes + 1, words), -1, dtype=torch.int32, device=device)
        from eyas.spec.grammar import apply_bitmask

        def drafted():
            return draft_phase(r.target, r.draft_for(tree), tree, r.draft_cache, static, r.block_size, r.use_triton,
                               r.simulated_accept, r.draft_hidden, root_masks, pen)

        def verified(d):
            return verify_phase(r.target, r.draft_for(tree), d, r.cache, static)

        def accepted(d, v):
            apply_bitmask(v.logits, masks)
            if pen is not None:
                pen.apply_to_tree(v.logits, d.node_tokens, d.tree.ancestor_mask)
            return accept_phase(r.draft_for(tree), d, v, r.cache, static, r.use_triton, r.simulated_accept,
                                mode == "greedy", r.draft_hidden, MAX_LOGPROBS if with_logprobs else None,
                                mode == "filtered")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(CAPTURE_WARMUPS):  # compile the Triton kernels and warm the allocator outside the capture
                d = drafted()
                accepted(d, verified(d))
        torch.cuda.current_stream().wait_stream(stream)
        graphs = [torch.cuda.CUDAGraph() for _ in range(3)]  # captured in the order they replay, in one pool
        with self._capturing(graphs[0]):
            d = drafted()
        self.pool = graphs[0].pool()
        with self._capturing(graphs[1]):
            v = verified(d)
        with self._capturing(graphs[2]):
            out = accepted(d, v)
        parents = d.tree.parents
        self.guided[key] = GuidedGraphs(
            *graphs, d, v, out, masks, torch.empty(masks.shape, dtype=torch.int32, pin_memory=True),
            torch.empty(d.node_tokens.shape, dtype=torch.long, pin_memory=True),
            torch.empty(parents.shape, dtype=torch.long, pin_memory=True).copy_(parents), torch.cuda.Event(),
            root_masks, None if root_masks is None else torch.empty((B, words), dtype=torch.int32, pin_memory=True),
            pen)

    def _capture_carry(self, static: DecodeInputs, out: DecodeOutputs) -> torch.cuda.CUDAGraph:
        """A graph of `carry_inputs` (static outputs -> static inputs, in place), warmed up on copies: of the inputs
        (a real run would carry them before their time) and of the outputs, zeroed (the step graph was only captured,
        never replayed: its outputs hold whatever their memory held)."""
        from eyas.spec.carry import carry_inputs
        r = self.runner

        def copies(x, fn):
            return dataclasses.replace(x, **{f.name: fn(getattr(x, f.name)) for f in dataclasses.fields(x)
                                             if isinstance(getattr(x, f.name), torch.Tensor)})
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            carry_inputs(copies(static, torch.clone), copies(out, torch.zeros_like), r.block_size, r.num_slots,
                         r.use_triton)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self._capturing(graph):  # (capturing runs nothing: the inputs are not carried yet)
            carry_inputs(static, out, r.block_size, r.num_slots, r.use_triton)
        self.pool = graph.pool()
        return graph


@dataclasses.dataclass(eq=False)
class GuidedGraphs:
    """A guided step's three graphs (`GraphedStep.launch_guided`) and the buffers between them: what the draft graph
    leaves for the others (`drafted`, `verified`: the graphs' own tensors, kept alive so that no later capture in the
    pool reuses them), the outputs, the masks on the device and their pinned host twins."""
    draft: torch.cuda.CUDAGraph
    verify: torch.cuda.CUDAGraph
    accept: torch.cuda.CUDAGraph
    drafted: object  # eyas.spec.step.Drafted
    verified: object  # eyas.spec.step.Verified
    out: DecodeOutputs
    masks: torch.Tensor  # [B, N1, words] int32, what the accept graph reads
    masks_host: torch.Tensor  # pinned
    tokens_host: torch.Tensor  # [B, N1] pinned: the drafted tree's tokens
    parents_host: torch.Tensor  # [N1] a static tree's parents (copied once), [B, N1] a dynamic tree's (each step)
    read: torch.cuda.Event  # the tokens (and a dynamic tree's parents) are on the host
    root_masks: torch.Tensor | None  # [B, words] int32, what the draft graph reads (None without a draft)
    root_masks_host: torch.Tensor | None  # pinned
    penalties: Penalties | None  # static inputs of the accept graph (`Penalties.fill`), when its key has them


@dataclasses.dataclass(eq=False)
class ExtrasGraph:
    """A step graph that reports log-probabilities or applies penalties (`GraphedStep.launch_extras`)."""
    graph: torch.cuda.CUDAGraph  # reads the B-row packer's device views (`_static_inputs`), as every graph of B does
    penalties: Penalties | None  # static inputs (`Penalties.fill`), when the key has them
    out: DecodeOutputs  # `logprobs` holds the top MAX_LOGPROBS of each committed token when the key has them
    carry: torch.cuda.CUDAGraph  # overlapped decoding: this graph's outputs -> the static inputs (`launch_extras`)
