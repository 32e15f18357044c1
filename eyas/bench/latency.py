"""`eyas bench latency`: TTFT, TTIT (ms per committed token), TPC and tokens/s by batch size, for plain decoding,
chains and trees, on SmolLM2 with its draft or on random-weight models of real shapes (simulated acceptance).

Each batch size runs waves of `batch` requests that start together. Two per-token times come out:
- TTIT (`ttit_ms`): the wave's decode time (all first tokens to the last request's end) over the tokens one request
  commits. Every request is charged until the slowest of its wave is done: with speculation, requests finish at
  different steps, and the wave's tail counts.
- TPOT (`tpot_ms`): each request's own time from the wave's decode start to its last token over the tokens it
  committed in that time, averaged over requests: vLLM's and SGLang's "mean TPOT" without the prefill steps of the
  wave, what a request sees when a finished request's slot would be taken by a new one. Equal to TTIT at batch 1
  and for plain decoding, where a wave's requests finish together.

Requests are greedy unless `--temperature` (with `--top-p`, `--top-k`) asks for sampled decoding: its steps take the
multi-round acceptance and the sampler (a softmax, or with a top-p or top-k filter a sort of the vocabulary), the
setting most services run at.

Writes latency.json, latency.md and latency.png (ms/token against batch size) to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.engine.heap import freeze_heap
from eyas.engine.sequence import Status
from eyas.layers.sampler import sampling_mode
from eyas.sampling_params import SamplingParams
from eyas.spec.draft_quant import apply_draft_quant, asks_quant
from eyas.spec.tree import resolve_tree


@dataclass(frozen=True)
class Sampling:
    """What every timed request asks for: greedy by default (issue #5's rows), or sampled at `temperature` with
    `top_p` / `top_k` filters."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    def params(self, i: int, n: int) -> SamplingParams:
        # explicit seeds: simulated acceptance and sampling draw from (seed, position), so the rows are reproducible,
        # and under tensor parallelism every rank draws the same (a per-rank random seed would make the ranks diverge)
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=n,
                              ignore_eos=True, seed=i)

    @property
    def mode(self) -> str:
        """The steps' sampling mode (`eyas.layers.sampler.sampling_mode`), whose graphs the warm-up captures."""
        return sampling_mode([self.params(0, 1)])


GREEDY = Sampling()


def load_models(model: str, draft: str | None, device, dtype, rank: int = 0, world_size: int = 1,
                shard_draft: bool = False):
    """-> (target, tokenizer, draft or None, simulated: bool). With `world_size` > 1, this rank's shard of the target
    (random shapes are built sharded; checkpoints through `eyas.dist.load_sharded`) and the draft replicated, or
    sharded with `shard_draft`."""
    from eyas.bench.shapes import SHAPES, random_draft, random_target
    if model in SHAPES:
        target = random_target(model, device, dtype, rank=rank, world_size=world_size)
        d = random_draft(target, config=SHAPES[model], rank=rank, world_size=world_size if shard_draft else 1)
        return target, None, d, True
    from eyas.loader.resolve import resolve_draft_arg
    if world_size > 1:
        from eyas.dist.tp import load_sharded
        target, tok, d = load_sharded(model, rank, world_size, device, dtype, resolve_draft_arg(model, draft),
                                      shard_draft=shard_draft)
        return target, tok, d, False
    from eyas.engine.llm import LLM
    llm = LLM(model, device=str(device), dtype=str(dtype).removeprefix("torch."), draft=resolve_draft_arg(model, draft),
              draft_quant="none")  # quantized by `measure`, as asked or as the draft's config says
    return llm.target, llm.tokenizer, llm.draft, False


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (how NOTES.md and issue 5 quote
    the H200's 4.18 TB/s); None off CUDA. The weight-read floor of a decode step is its weight bytes over this."""
    if device.type != "cuda":
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    end.synchronize()
    bw = 2 * nbytes * reps / (start.elapsed_time(end) / 1000)
    del a, b
    torch.cuda.empty_cache()
    return bw


def rates_from_tpc_report(path: str | Path, temperature: float = 0.0) -> list[float]:
    """Per-depth conditional acceptance rates recorded by `eyas bench tpc` (its tpc.json) for one draft: from the
    longest chain measured at `temperature`, rate_d = acc_d / acc_{d-1} (acc_0 = 1), the chance that depth d is
    accepted once depth d-1 was. This replays a real draft's profile on random-weight shapes."""
    report = json.loads(Path(path).read_text())
    rows = [r for r in report.get("results", []) if r["speculation"].startswith("chain:")
            and abs(r["temperature"] - temperature) < 1e-9]
    drafts = sorted({str(r.get("draft")) for r in rows})
    if not rows:
        raise ValueError(f"{path}: no chain measured at temperature {temperature}")
    if len(drafts) > 1:
        raise ValueError(f"{path} holds several drafts ({', '.join(drafts)}): give a report of one")
    acc = max(rows, key=lambda r: len(r["acceptance_by_depth"]))["acceptance_by_depth"]
    rates, prev = [], 1.0
    for a in acc:
        if a <= 0 or prev <= 0:
            break
        rates.append(min(a / prev, 1.0))
        prev = a
    if not rates:
        raise ValueError(f"{path}: nothing was accepted at depth 1")
    return rates


def attention_pdl(device: torch.device) -> bool:
    """Whether the row paths' attention kernels take programmatic dependent launch here (`eyas.kernels.tree_attention
    .PDL`, on by default since session 20, and an sm_90+ GPU), as the bench's JSON records it."""
    if device.type != "cuda":
        return False
    from eyas.kernels import tree_attention
    from eyas.models.one_row import use_pdl
    return bool(tree_attention.PDL) and use_pdl(device)


def load_ranks(path: str | Path) -> torch.Tensor:
    """A rank-path recording ([T, R] int, `ranks` in a safetensors file) for `--accept-ranks`."""
    from safetensors.torch import load_file
    try:
        ranks = load_file(str(path)).get("ranks")
    except Exception as e:  # not a file, not safetensors
        raise ValueError(f"--accept-ranks {path}: cannot read it ({type(e).__name__}: {e})") from None
    if ranks is None or ranks.dim() != 2 or ranks.is_floating_point() or ranks.shape[0] == 0:
        raise ValueError(f"--accept-ranks {path}: expected an integer tensor `ranks` [T, R] with T >= 1")
    return ranks.long()


def parse_acceptance(accept_ranks: str | None, accept_rates: str) -> torch.Tensor | list[float]:
    """Simulated acceptance from the command line: recorded rank paths (`--accept-ranks`, a tensor), else per-depth
    rates from a tpc.json report or a comma-separated list (`--accept-rates`). ValueError if unreadable."""
    if accept_ranks:
        return load_ranks(accept_ranks)
    if Path(accept_rates).is_file():
        return rates_from_tpc_report(accept_rates)
    return [float(x) for x in accept_rates.split(",")]


def simulate_acceptance(engine: LLMEngine, accept: torch.Tensor | list[float]) -> None:
    """Make a random-weight engine replay a real draft's rank paths (a tensor), or accept each depth at the given
    rates (the last rate repeats for deeper levels). Benchmarks only (`spec_step`)."""
    dev = engine.runner.device
    if isinstance(accept, torch.Tensor):
        engine.runner.simulated_accept = accept.to(dev)
    else:
        D = engine.tree.max_depth
        engine.runner.simulated_accept = torch.tensor((list(accept) + [accept[-1]] * D)[:D], device=dev)


def spread(total: int, n: int) -> list[int]:
    """n indices spread evenly over range(total) (all of them, cycled, when n >= total): 8 of MT-Bench's 80
    questions, which come sorted by category, ten each, are one question of each category."""
    if n >= total:
        return [i % total for i in range(n)]
    return [i * total // n for i in range(n)]


def make_prompts(tokenizer, vocab: int, n: int, context: int, prompts_file: str | None) -> list[list[int]]:
    if tokenizer is not None and prompts_file:
        from eyas.bench.tpc import read_prompts
        qs = read_prompts(prompts_file)
        if not qs:
            raise ValueError(f"no prompts in {prompts_file}")
        return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": qs[i]["text"]}]),
                                 add_bos=False)
                for i in spread(len(qs), n)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (context,), generator=g).tolist() for _ in range(n)]


def split_modes(text: str) -> list[str]:
    """`plain,chain:3,dispatch:1=tree:8,16=plain` -> ["plain", "chain:3", "dispatch:1=tree:8,16=plain"]: items of
    the form `B=SPEC` continue the dispatch before them."""
    modes: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if modes and modes[-1].startswith("dispatch:") and re.match(r"^\d+=", item):
            modes[-1] += "," + item
        elif item:
            modes.append(item)
    return modes


def simulates(mode: str, simulated_rates) -> bool:
    """Whether a row's acceptance is simulated: on random weights (`simulated_rates` given), except a dynamic tree's,
    which cannot be replayed: its row there is real acceptance, ~nothing accepted, and gives its time a step
    (`ms_per_decode_step`)."""
    return simulated_rates is not None and not mode.startswith("dyn:")


def check_max_model_len(max_model_len: int | None, prompts, max_tokens: int) -> None:
    """A `max_model_len` must hold the longest prompt and `max_tokens` after it (ValueError)."""
    longest = max(len(p) for p in prompts)
    if max_model_len is not None and max_model_len < longest + max_tokens:
        raise ValueError(f"--max-model-len {max_model_len} is shorter than the longest prompt ({longest} tokens) "
                         f"plus --max-tokens {max_tokens}")


def build_engine(target, tokenizer, draft, mode: str, batch: int, prompts, max_tokens: int, simulated_rates,
                 graphs: bool, block_size: int = 16, one_row: bool = True, few_rows: bool = True,
                 fold_norms: bool = True, overlap: bool = True, max_model_len: int | None = None,
                 sampling: Sampling = GREEDY) -> LLMEngine:
    """An engine for one (mode, batch) row, warmed up: kernels compiled and, with `graphs`, the graphs of every batch
    bucket it will pass through captured. `max_model_len`: the engine's context bound (default: the longest prompt
    plus max_tokens plus 64, the least that fits; a server keeps the model's whole context, which widens the block
    tables that the graphs and the attention's split count are sized by)."""
    tree = None if mode == "plain" else resolve_tree(mode)
    longest = max(len(p) for p in prompts)
    need = longest + max_tokens + 64
    check_max_model_len(max_model_len, prompts, max_tokens)
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, longest), cuda_graphs=graphs,
                       block_size=block_size, max_model_len=min(target.config.max_position_embeddings,
                                                                max_model_len or need),
                       num_blocks=batch * (-(-need // block_size)) + 8, one_row=one_row,
                       few_rows=few_rows, fold_norms=fold_norms, overlap=overlap and graphs,
                       prefix_caching=False)  # the warm-up's prompts are the measured ones: TTFT would time hits
    engine = LLMEngine(target, tokenizer, draft if tree is not None else None, tree, cfg)
    if tree is not None and simulates(mode, simulated_rates):
        simulate_acceptance(engine, simulated_rates)
    # warm-up: captures the graph of this batch size and compiles the kernels
    for i, p in enumerate(prompts[:batch]):
        engine.add_request(p, sampling.params(i, 4))
    while engine.has_unfinished():
        engine.step()
    if engine.runner.graphs is not None:
        # every bucket the batch shrinks through as sequences finish (simulated acceptance finishes them at
        # different steps): captured here, not inside the timed decode
        engine.runner.graphs.capture_all(batch, modes=(sampling.mode,))
        # and every padded shape its prefills take (`eyas.engine.prefill_graph`): not captured inside a timed TTFT
        engine.runner.prefill_graphs.capture_all(batch, longest)
    # the objects built so far (model, graphs, caches) live as long as the engine: collected once and frozen, so
    # that no full collection has to scan them during a timed run. Hygiene, not a measured fix: session 17 saw the
    # first of two interleaved rounds 5-20% slower in every mode after 14 engines were built, and with this in place
    # still saw single runs 10-22% slower than their neighbours, at no fixed position
    freeze_heap("bench")
    return engine


def replay_seeds(prompt_lens: list[int], rows: int) -> list[int]:
    """Seeds for a recording of `rows` rank paths replayed (`eyas.spec.verifier.simulate_replay`: a sequence at
    position n reads row (seed + n) mod rows): sequence j of P, whose first decode step is at position
    prompt_lens[j], starts at row j * rows // P, so that the P sequences read the recording evenly, each its own
    stretch. (Seeds that scatter the sequences at random make them overlap in places and skip others: over 80
    prompts x 128 tokens of a 9,513-row recording whose whole replays to TPC 2.48, random offsets drew 2.38 or
    2.52 by the context length alone.)"""
    P = len(prompt_lens)
    return [(j * rows // P - n) % rows for j, n in enumerate(prompt_lens)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_row(engine: LLMEngine, mode: str, batch: int, prompts, max_tokens: int, num_prompts: int = 1,
             simulated: bool = False, sampling: Sampling = GREEDY) -> dict:
    """One measured row on a warmed-up engine (`build_engine`): waves of `batch` requests until `num_prompts` prompts
    ran (one wave when the batch is larger; at batch 1 a single prompt would make the row the acceptance of that one
    prompt). `simulated`: the row's model has random weights (acceptance simulated)."""
    waves = max(1, -(-num_prompts // batch))
    order = spread(len(prompts), waves * batch)  # spread over the prompt list (its categories), not its head
    seeds = list(range(waves * batch))
    ranks = engine.runner.simulated_accept
    if ranks is not None and not ranks.is_floating_point():  # a recording replayed: read it evenly
        seeds = replay_seeds([len(prompts[o]) for o in order], ranks.shape[0])
    ttft = decode_s = total_s = per_seq_tokens = 0.0
    tokens = calls = decode_tokens = steps = 0
    tpots: list[float] = []
    for w in range(waves):
        wave = [prompts[order[w * batch + i]] for i in range(batch)]
        _sync()
        steps0 = engine.step_counts["decode"]
        t0 = time.perf_counter()
        seqs = [engine.add_request(p, sampling.params(seeds[w * batch + i], max_tokens)) for i, p in enumerate(wave)]
        first = None
        # each request's own finish time (the host knows it once the step that finished it returns), for its time
        # per output token (TPOT): a request that finishes early is not charged the steps its batch-mates still
        # take. Timed from the wave's decode start, like TTIT, so that neither counts the wave's prefills (requests
        # admitted first would otherwise be charged their batch-mates' prefill steps)
        done, n_first = [None] * batch, [0] * batch
        while engine.has_unfinished():
            engine.step()
            if first is not None:
                now = time.perf_counter()
                for i, s in enumerate(seqs):
                    if done[i] is None and s.status == Status.FINISHED:
                        done[i] = now
            if first is None and all(s.num_output > 0 for s in seqs):
                _sync()
                first = time.perf_counter()
                n_first = [s.num_output for s in seqs]
        _sync()
        t1 = time.perf_counter()
        first = first or t1
        steps += engine.step_counts["decode"] - steps0
        ttft += first - t0
        decode_s += t1 - first
        total_s += t1 - t0
        n_tok = sum(s.num_output for s in seqs)
        tokens += n_tok
        calls += sum(s.stats.target_calls for s in seqs)
        decode_tokens += n_tok - len(seqs)  # the first token of each comes from prefill
        per_seq_tokens += (n_tok - len(seqs)) / len(seqs)
        tpots += [(d - first) * 1000 / (s.num_output - n0) for s, n0, d in zip(seqs, n_first, done)
                  if d is not None and s.num_output > n0]
    return {
        "mode": mode, "batch": batch, "prompts": waves * batch, "ttft_ms": ttft * 1000 / waves,
        "ttit_ms": decode_s * 1000 / max(per_seq_tokens, 1e-9),
        "tpot_ms": sum(tpots) / len(tpots) if tpots else None,
        "tpc": decode_tokens / calls if calls else 1.0, "tokens_per_s": tokens / total_s,
        "decode_steps": steps, "ms_per_decode_step": decode_s * 1000 / max(steps, 1),
        "new_tokens": max_tokens, "simulated_acceptance": simulated,
    }


def profile_steps(engine: LLMEngine, mode: str, batch: int, prompts, verbose: bool = True,
                  kernels_out: str | None = None, sampling: Sampling = GREEDY) -> None:
    """Print where the GPU time of the decode steps of 3 `step()` calls goes, by kernel (torch.profiler).
    `kernels_out`: also write every kernel of those steps in launch order (start and gap before it in us, duration
    in us, name), a TSV, to read a step's sequence (which launch belongs to the draft, which to the verify pass)
    where the table only sums."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for i, p in enumerate(prompts[:batch]):
        engine.add_request(p, sampling.params(i, 12))
    while any(s.in_prefill or s.status.value == "waiting" for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    n0 = engine.step_counts["decode"]
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        _sync()
    # the steps launched: with overlapped decoding the first step() also enqueues its successor (4 steps, not 3)
    steps = max(1, engine.step_counts["decode"] - n0)
    if verbose:
        print(f"--- profile: {mode}, batch {batch}, {steps} decode steps ---")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1000
        print(f"GPU kernels per step: {len(kernels) / steps:.0f}, busy {busy / steps:.3f} ms per step")
        if kernels_out:
            write_kernel_timeline(kernels, kernels_out)
            print(f"kernels in launch order: {kernels_out}")
    while engine.has_unfinished():
        engine.step()


def write_kernel_timeline(kernels, path: str) -> None:
    """Profiler kernel events -> TSV rows `start_us  gap_us  dur_us  name` in start order (start from the first)."""
    ev = sorted(kernels, key=lambda e: e.time_range.start)
    t0 = ev[0].time_range.start if ev else 0
    end = t0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("start_us\tgap_us\tdur_us\tname\n")
        for e in ev:
            start, stop = e.time_range.start, e.time_range.end
            f.write(f"{start - t0:.1f}\t{max(0.0, start - end):.1f}\t{stop - start:.1f}\t{e.name[:120]}\n")
            end = max(end, stop)


def run_mode(target, tokenizer, draft, mode: str, batch: int, prompts, max_tokens: int, simulated_rates,
             graphs: bool, block_size: int = 16, profile: bool = False, num_prompts: int = 1,
             verbose: bool = True, one_row: bool = True, few_rows: bool = True, fold_norms: bool = True,
             kernels_out: str | None = None, overlap: bool = True, max_model_len: int | None = None,
             sampling: Sampling = GREEDY) -> dict:
    """One (mode, batch) row: `build_engine`, `time_row`, and with `profile` `profile_steps`."""
    engine = build_engine(target, tokenizer, draft, mode, batch, prompts, max_tokens, simulated_rates, graphs,
                          block_size, one_row, few_rows, fold_norms, overlap, max_model_len, sampling)
    row = time_row(engine, mode, batch, prompts, max_tokens, num_prompts, simulates(mode, simulated_rates), sampling)
    if profile:
        profile_steps(engine, mode, batch, prompts, verbose, kernels_out, sampling)
    return row


def median_row(runs: list[dict]) -> dict:
    """The row of the median TTIT among repeated runs of one (mode, batch), with every run's TTIT and ms/step
    (`repeats_ttit_ms`, `repeats_ms_per_step`, in run order)."""
    row = dict(sorted(runs, key=lambda r: r["ttit_ms"])[(len(runs) - 1) // 2])
    row["repeats_ttit_ms"] = [r["ttit_ms"] for r in runs]
    row["repeats_ms_per_step"] = [r["ms_per_decode_step"] for r in runs]
    return row


def add_speedups(rows: list[dict]) -> None:
    """Each row's speed-up over plain decoding at its batch size (`speedup_vs_plain`: plain's TTIT / the row's), when
    a plain row exists. With --repeat, the median over the rounds of the ratio of the two runs of that round
    (`speedup_vs_plain_runs`, in run order): a round's modes ran back to back, so a slow stretch of the machine
    lands on both and cancels, which a ratio of the two medians does not do."""
    from statistics import median
    plain = {r["batch"]: r for r in rows if r["mode"] == "plain"}
    for r in rows:
        p = plain.get(r["batch"])
        if p is None:
            continue
        a, b = p.get("repeats_ttit_ms"), r.get("repeats_ttit_ms")
        if a and b and len(a) == len(b):
            r["speedup_vs_plain_runs"] = [x / y for x, y in zip(a, b)]
            r["speedup_vs_plain"] = median(r["speedup_vs_plain_runs"])
        else:
            r["speedup_vs_plain"] = p["ttit_ms"] / r["ttit_ms"]


def suggest_dispatch(rows: list[dict], metric: str = "ttit") -> dict | None:
    """The tree dispatcher these rows argue for: at each batch size the mode (plain, a chain or a tree; measured
    dispatchers and temperature bands are not candidates) with the least TTIT or TPOT (`metric`; TPOT falls back to
    TTIT where a row has none), composed by `eyas.spec.dispatch.compose_dispatch`. None when no batch size has a speculative candidate
    (a dispatcher of plain entries only is no dispatcher). Ties go to the mode measured first."""
    from eyas.spec.dispatch import compose_dispatch
    if metric not in ("ttit", "tpot"):
        raise ValueError(f"suggest_dispatch: metric must be 'ttit' or 'tpot', got {metric!r}")
    best: dict[int, tuple[float, str]] = {}
    for r in rows:
        if r["mode"].startswith("dispatch:") or "|" in r["mode"]:  # a dispatcher, or temperature bands
            continue
        v = r["tpot_ms"] if metric == "tpot" and r.get("tpot_ms") is not None else r["ttit_ms"]
        if r["batch"] not in best or v < best[r["batch"]][0]:
            best[r["batch"]] = (v, r["mode"])
    choice = {b: m for b, (_, m) in sorted(best.items())}
    if all(m == "plain" for m in choice.values()):
        return None
    return {"metric": metric, "spec": compose_dispatch(choice), "per_batch": {str(b): m for b, m in choice.items()}}


def markdown(rows: list[dict], meta: dict) -> str:
    sim = " (simulated acceptance)" if meta.get("simulated") else ""
    tp = f", tensor parallel {meta['tensor_parallel']}" if meta.get("tensor_parallel", 1) > 1 else ""
    if tp and meta.get("draft_sharded"):
        tp += " (draft sharded)"
    elif tp:
        tp += " (draft replicated)"
    t = meta.get("temperature", 0.0)
    samp = "" if not t else (f", sampled at temperature {t:g}" + (f", top-p {meta['top_p']:g}" if meta.get("top_p", 1) < 1
                                                                 else "")
                             + (f", top-k {meta['top_k']}" if meta.get("top_k", -1) > 0 else ""))
    out = [f"model `{meta['model']}`{sim}{tp}{samp}, {meta['device_name']}, {meta['dtype']}, {meta['date']}"]
    floor = meta.get("weight_read_floor_ms")
    if floor:
        out.append(f"weight-read floor {floor:.3f} ms per step: {meta['linear_weight_bytes'] / 1e9:.2f} GB of linear "
                   f"weights per GPU at the measured copy bandwidth {meta['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    runs = any("repeats_ttit_ms" in r for r in rows)  # --repeat: each row is the run of median TTIT
    vs = any("speedup_vs_plain" in r for r in rows)
    vs_head = " vs plain (median of the rounds) |" if runs else " vs plain |"
    out += ["", "| mode | batch | TTFT ms | ms/token (TTIT) | TPOT ms | TPC | tokens/s | decode steps | ms/step |"
            + (" TTIT / floor |" if floor else "") + (vs_head if vs else "") + (" TTIT of the runs |" if runs else ""),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if floor else "")
            + (" --- |" if vs else "") + (" --- |" if runs else "")]
    for r in rows:
        tpot = f"{r['tpot_ms']:.3f}" if r.get("tpot_ms") is not None else ""
        reps = ", ".join(f"{t:.3f}" for t in r.get("repeats_ttit_ms", []))
        sp = f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else ""
        out.append(f"| {r['mode']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['ttit_ms']:.3f} | {tpot} | "
                   f"{r['tpc']:.2f} | {r['tokens_per_s']:.0f} | {r['decode_steps']} | {r['ms_per_decode_step']:.3f} |"
                   + (f" {r['ttit_ms'] / floor:.2f} |" if floor else "") + (f" {sp} |" if vs else "")
                   + (f" {reps} |" if runs else ""))
    sd = meta.get("suggested_dispatch")
    if sd:
        out += ["", f"Fastest mode by {sd['metric'].upper()} at each batch size, as a dispatcher (`--speculation`, or a "
                    f"draft's config.json `eyas_speculation`): `{sd['spec']}`"]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    """ms per committed token against batch size, a colour per mode: TTIT solid, TPOT dashed (where a batch > 1 has
    it); the legend (a line per mode, then the two styles) beside the axes, so that it hides no curve."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    fig, ax = plt.subplots(figsize=(10, 4.5))
    has_tpot = False
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        line, = ax.plot([r["batch"] for r in rs], [r["ttit_ms"] for r in rs], marker="o", label=mode)
        tp = [(r["batch"], r["tpot_ms"]) for r in rs if r.get("tpot_ms") is not None]
        if any(b > 1 for b, _ in tp):  # at batch 1 the two are one figure
            ax.plot(*zip(*tp), marker="x", linestyle="--", color=line.get_color())
            has_tpot = True
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per committed token (per sequence)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    styles = [Line2D([], [], color="grey", marker="o", label="TTIT (solid)")]
    if has_tpot:
        styles.append(Line2D([], [], color="grey", marker="x", linestyle="--", label="TPOT (dashed)"))
    ax.legend(handles=handles + styles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse(args):
    """-> (modes, batch sizes, acceptance); bad input exits before any model is loaded."""
    modes = split_modes(args.modes)
    try:
        for m in modes:
            if m != "plain":
                resolve_tree(m)
        batches = [int(b) for b in args.batch_sizes.split(",")]
        if not batches or min(batches) < 1:
            raise ValueError("batch sizes must be >= 1")
        accept = parse_acceptance(args.accept_ranks, args.accept_rates)
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if args.repeat < 1:
            raise ValueError("--repeat must be >= 1")
        Sampling(args.temperature, args.top_p, args.top_k).params(0, 1)  # SamplingParams' own checks
        from eyas.bench.shapes import SHAPES
        if args.temperature > 0 and args.model in SHAPES and any(simulates(m, [0.0]) for m in modes):
            raise ValueError("--temperature > 0 times the sampled acceptance, which a random-weight shape's simulated "
                             "acceptance replaces: use a real model and draft, or --modes plain")
        if args.max_model_len is not None and args.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2")
        if args.draft_vocab < 0:
            raise ValueError("--draft-vocab must be >= 1 (or 0: the whole vocabulary)")
        if args.tensor_parallel < 1:
            raise ValueError("--tensor-parallel must be >= 1")
        if args.tensor_parallel > 1 and args.draft_vocab:
            raise ValueError("--draft-vocab does not combine with --tensor-parallel (the draft vocabulary slices the "
                             "LM head, which tensor parallelism shards by vocabulary)")
        if args.tensor_parallel > 1 and asks_quant(args.draft_quant):
            raise ValueError("--draft-quant does not combine with --tensor-parallel yet")
    except ValueError as e:
        raise SystemExit(f"eyas bench latency: {e}") from None
    return modes, batches, accept


def measure(args, modes, batches, accept, device, rank: int = 0, world_size: int = 1):
    """Every (mode, batch) row on this rank -> (rows, meta). Under tensor parallelism every rank runs the same rows
    in lockstep (the same prompts, seeds and schedule, hence the same collectives); rank 0's timings are reported."""
    from tqdm.auto import tqdm
    from eyas.loader.resolve import resolve_dtype
    dtype = resolve_dtype(args.dtype, device)
    from eyas.bench.shapes import SHAPES
    bw = copy_bandwidth(device) if args.model in SHAPES else None  # the floor is reported for random shapes only
    target, tokenizer, draft, simulated = load_models(args.model, args.draft, device, dtype, rank, world_size,
                                                      args.tp_draft == "sharded")
    if args.draft_vocab:
        if not simulated or draft is None:
            raise SystemExit("eyas bench latency: --draft-vocab is for random-weight shapes (a trained draft carries "
                             "its own draft_vocab.safetensors)")
        from eyas.spec.draft_vocab import attach_draft_vocab
        attach_draft_vocab(draft, target, torch.arange(min(args.draft_vocab, target.config.vocab_size)))
    if asks_quant(args.draft_quant) and draft is None:
        raise SystemExit("eyas bench latency: --draft-quant needs a draft")
    from eyas.spec.ngram import NgramProposer
    if isinstance(draft, NgramProposer):  # `--draft ngram`: proposals from the prompts' own tokens, chains only
        if asks_quant(args.draft_quant):
            raise SystemExit("eyas bench latency: --draft-quant needs a draft model, not n-gram proposals")
    elif draft is not None and world_size == 1:  # as asked, or the draft's own choice (SmolLM2's: fp8-head on a GPU)
        apply_draft_quant(draft, target, args.draft_quant, cuda_kernel=args.int4_kernel)
    rates = accept if simulated else None
    if draft is None and any(m != "plain" for m in modes):
        if rank == 0:
            print(f"no draft for {args.model}: measuring plain decoding only")
        modes = [m for m in modes if m == "plain"]
    prompts = make_prompts(tokenizer, target.config.vocab_size, max(max(batches), args.num_prompts), args.context,
                           args.prompts)
    try:  # before any engine is built
        check_max_model_len(args.max_model_len, prompts, args.max_tokens)
    except ValueError as e:
        raise SystemExit(f"eyas bench latency: {e}") from None
    graphs = args.cuda_graphs and device.type == "cuda"
    rows = []
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    paths = dict(one_row=args.one_row, few_rows=args.few_rows, fold_norms=args.fold_norms, overlap=args.overlap,
                 max_model_len=args.max_model_len, sampling=sampling)

    def timeline(mode: str, b: int) -> str | None:  # --profile's kernel list, beside the outputs
        if not (args.profile and args.out and rank == 0):
            return None
        return str(Path(args.out) / f"kernels_{re.sub(r'[^A-Za-z0-9]+', '_', mode)}_b{b}.tsv")
    if args.repeat == 1:
        for mode in modes:
            for b in tqdm(batches, desc=mode, disable=rank != 0):
                rows.append(run_mode(target, tokenizer, draft, mode, b, prompts, args.max_tokens, rates, graphs,
                                     profile=args.profile, num_prompts=args.num_prompts, verbose=rank == 0,
                                     kernels_out=timeline(mode, b), **paths))
    else:  # per batch size, every mode's engine built once, then the modes' runs interleaved `repeat` times
        by_mode: dict[str, list[dict]] = {}
        for b in batches:
            engines = {m: build_engine(target, tokenizer, draft, m, b, prompts, args.max_tokens, rates, graphs,
                                       **paths) for m in modes}
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in tqdm(range(args.repeat), desc=f"batch {b}, {len(modes)} modes", disable=rank != 0):
                for m in modes:
                    runs[m].append(time_row(engines[m], m, b, prompts, args.max_tokens, args.num_prompts,
                                            simulates(m, rates), sampling))
            for m in modes:
                by_mode.setdefault(m, []).append(median_row(runs[m]))
                if args.profile:
                    profile_steps(engines[m], m, b, prompts, rank == 0, timeline(m, b), sampling)
            del engines
        rows = [r for m in modes for r in by_mode[m]]
    add_speedups(rows)
    meta = {"model": args.model, "draft": args.draft, "device": str(device),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else platform.processor() or platform.machine()),  # processor() may be empty (Linux)
            "dtype": str(dtype), "date": str(date.today()), "simulated": simulated,
            "accept_rates": None if isinstance(rates, torch.Tensor) else rates,
            "accept_ranks": args.accept_ranks if simulated and args.accept_ranks else None,
            "context": args.context, "max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
            "max_model_len": args.max_model_len,
            "draft_vocab": args.draft_vocab or None, "draft_quant": getattr(draft, "quant", None),
            "int4_kernel": args.int4_kernel if getattr(draft, "quant", None) else None, "cuda_graphs": graphs,
            "one_row": args.one_row and device.type == "cuda", "few_rows": args.few_rows and device.type == "cuda",
            "fold_norms": bool(getattr(target, "norms_folded", False)),  # as the runners left it (not under TP)
            "overlap": args.overlap and graphs,
            "attention_pdl": attention_pdl(device) and (args.one_row or args.few_rows),
            "tensor_parallel": world_size, "draft_sharded": args.tp_draft == "sharded" and world_size > 1,
            "repeat": args.repeat, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k, "sampling_mode": sampling.mode}
    if simulated:
        from eyas.bench.shapes import linear_weight_bytes
        meta["linear_weight_bytes"] = linear_weight_bytes(target)  # of one rank's shard under TP
        if bw:  # every rank reads its own shard at the same time: the step cannot beat one shard over one GPU's copy
            meta["copy_bytes_per_s"] = bw
            meta["weight_read_floor_ms"] = meta["linear_weight_bytes"] / bw * 1000
    if args.suggest_dispatch:
        meta["suggested_dispatch"] = suggest_dispatch(rows, args.suggest_dispatch)
    return rows, meta


def write_outputs(out: str | Path, rows: list[dict], meta: dict) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latency.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    (out / "latency.md").write_text(markdown(rows, meta))
    tp = f", TP = {meta['tensor_parallel']}" if meta.get("tensor_parallel", 1) > 1 else ""
    plot(rows, out / "latency.png", f"{meta['model']}{tp}{' (simulated acceptance)' if meta['simulated'] else ''}")
    print(markdown(rows, meta))


def _tp_rank(rank: int, world_size: int, device, args, modes, batches, accept) -> None:
    """One rank of `eyas bench latency --tensor-parallel N` (started by `eyas.dist.spawn`)."""
    rows, meta = measure(args, modes, batches, accept, device, rank, world_size)
    if rank == 0:
        write_outputs(args.out, rows, meta)


def run(args) -> int:
    from eyas.loader.resolve import resolve_device
    modes, batches, accept = _parse(args)
    device = resolve_device(args.device)
    W = args.tensor_parallel
    if W > 1:
        from eyas.dist.launch import run_ranks
        run_ranks(_tp_rank, W, args, modes, batches, accept, on_gpu=device.type == "cuda", timeout=args.timeout)
        return 0
    rows, meta = measure(args, modes, batches, accept, device)
    write_outputs(args.out, rows, meta)
    return 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("latency", help="TTFT, ms/token, TPC and tokens/s by batch size")
    p.add_argument("--model", default="smollm2", help="smollm2, a checkpoint, or llama-3.1-8b-shape, "
                                                      "llama-3.3-70b-shape, smollm2-shape (random weights)")
    p.add_argument("--draft", default="auto")
    p.add_argument("--modes", default="plain,chain:3,tree:8",
                   help="comma-separated: plain, chain:K, tree:NAME, dyn:kKdDnN, dispatch:B1=SPEC,B2=SPEC,...")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts per row: batches smaller than this run in waves until it is reached")
    p.add_argument("--suggest-dispatch", choices=["ttit", "tpot"], default=None,
                   help="also print (and write to the JSON and the table) the tree dispatcher these rows argue for: "
                        "the fastest of the measured plain, chain and tree modes at each batch size by this metric")
    p.add_argument("--repeat", type=int, default=1,
                   help="time every row this many times, the modes' runs interleaved on engines built once per batch "
                        "size, and report the run of median TTIT (all runs' TTIT in the JSON and the table): rows "
                        "of one process move by several percent run to run on a GPU, and interleaving spreads that "
                        "over the modes compared")
    p.add_argument("--context", type=int, default=1024, help="prompt length for random-weight models")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample every request at this temperature (default 0: greedy); the acceptance is then the "
                        "multi-round rule, and each step samples (real models only for speculative modes)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature: nucleus filter (radix selection on the Triton path, a sort otherwise)")
    p.add_argument("--top-k", type=int, default=-1, help="with --temperature: top-k filter (-1: off)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's context bound, as a server sets it (default: the longest prompt + "
                        "--max-tokens + 64; the model's own context at most)")
    p.add_argument("--prompts", default=None, help="MT-Bench question.jsonl (first turns) for real models")
    p.add_argument("--accept-rates", default="0.8",
                   help="simulated acceptance (random weights): per-depth conditional rates, comma-separated, or "
                        "an `eyas bench tpc` tpc.json of one draft (its longest chain at T=0)")
    p.add_argument("--accept-ranks", default=None,
                   help="simulated acceptance replayed from a real draft's recorded rank paths (a safetensors file "
                        "with `ranks` [T, R], from `eyas make-tree --save-eval-ranks`): exact for any tree, where "
                        "--accept-rates follows each node's rank-0 child only")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="random-weight shapes: the draft proposes only this many token ids (the cost of a reduced "
                        "draft vocabulary; acceptance stays simulated)")
    from eyas.spec.draft_quant import add_draft_quant_arg
    add_draft_quant_arg(p, "quantize the draft (eyas.spec.draft_quant): its FFN and/or its own LM head copy in "
                           "INT4; with random shapes acceptance stays simulated, so this times the saving only")
    p.add_argument("--int4-kernel", default="torch", choices=["torch", "triton"],
                   help="with --draft-quant on CUDA: PyTorch's tinygemm (torch) or eyas's Triton INT4 GEMV")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="shard the target over N ranks (N GPUs, NCCL; gloo on the CPU), started by this command")
    p.add_argument("--tp-draft", choices=["sharded", "replicated"], default="sharded",
                   help="with --tensor-parallel: shard the draft like the target (default; measured faster on the "
                        "H200 x2), or give every rank all of it")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="with --tensor-parallel: seconds after which every rank is killed (never wait forever)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--no-one-row", dest="one_row", action="store_false",
                   help="keep batch-1 plain decode steps on the fused path (cuBLAS), without the one-row kernels "
                        "(eyas.models.one_row): to compare the two")
    p.add_argument("--no-few-rows", dest="few_rows", action="store_false",
                   help="keep verify passes and plain steps of 2-64 tokens on the fused path (cuBLAS), without the "
                        "tile kernels (eyas.models.one_row; taken for small models only): to compare the two")
    p.add_argument("--no-fold-norms", dest="fold_norms", action="store_false",
                   help="keep the target's RMSNorm kernels (eyas.models.fused.fold_norms folds their weights into "
                        "the projections and applies them inside other launches): to compare the two")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="read every decode step back before enqueueing the next (with CUDA graphs, the next step of "
                        "an unchanged batch is otherwise enqueued first, its inputs carried on the device: "
                        "eyas.spec.carry): to compare the two")
    p.add_argument("--profile", action="store_true",
                   help="print the top GPU kernels of 3 step() calls' decode steps per run (4 steps where the "
                        "first enqueues a successor); also write those steps' kernels in "
                        "launch order to OUT/kernels_<mode>_b<batch>.tsv")
    p.add_argument("--out", default="bench-out/latency")
    p.set_defaults(func=run)
    return p
