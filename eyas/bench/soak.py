"""`eyas bench soak`: a long run of random traffic through the engine, to show it never deadlocks, loses a request or
leaks a KV block; under tensor parallelism (`--tensor-parallel N`) also that the ranks never disagree.

Rank 0 (the only rank that takes requests, `eyas.dist.TPEngine`) admits requests at random: bursts (`--burst-rate`
requests/s for 2-10 s) and quiet spells (`--quiet-rate` for 5-20 s), with at most 2 x `--max-batch` requests queued
or running, so the running batch moves through every size up to `--max-batch` and back to 1, and a tree dispatcher
picks a different speculation per batch size. Requests mix greedy and sampled decoding (temperature, top-k, top-p),
prompt lengths and output lengths, and one in four asks for extras (log-probabilities, penalties, a logit bias,
allowed tokens, min_tokens, bad words); a few are aborted while running, and a few are refused (too long).
Acceptance is real for a checkpoint and its draft, and simulated for random-weight shapes (`--accept-ranks`/
`--accept-rates`), so the number of tokens accepted per step varies as it would with a real draft (the case where
ranks that disagreed would deadlock, SGLang issue 31071). With `TPEngine(check=True)` every step all-gathers each
rank's outputs and raises if they differ.

Every `--report-every` seconds and at the end, rank 0 writes `soak.json` (steps, requests admitted / finished /
aborted / refused, tokens, the batch sizes seen, step-time percentiles, the longest step, KV blocks in use at the
end). The run passes if every admitted request finished or was aborted, no block is left in use and no rank
diverged or hung: `eyas.dist.spawn` kills every rank at `--duration` + `--grace` seconds, so a deadlock ends the
command with an error instead of hanging it.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from eyas.bench.latency import load_models, parse_acceptance, simulate_acceptance
from eyas.engine.engine import EngineConfig, LLMEngine
from eyas.sampling_params import SamplingParams
from eyas.spec.tree import resolve_tree


def _request(rng: random.Random, vocab: int, max_len: int, max_prompt: int, max_tokens: int, priority: bool = False):
    """A random request: (prompt ids, params). One in 50 is too long for the engine (refused on every rank).
    `priority` (the priority policy): a random priority in 0..3."""
    if rng.random() < 0.02:
        n = max_len + 1
    else:
        n = int(min(max_prompt, max(1, rng.lognormvariate(4.5, 1.2))))
    prompt = [rng.randrange(10, vocab) for _ in range(n)]
    m = rng.randint(1, max_tokens)
    extras = _extras(rng, vocab, m) | ({"priority": rng.randint(0, 3)} if priority else {})
    if rng.random() < 0.5:
        params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, **extras)
    else:
        params = SamplingParams(temperature=rng.choice([0.6, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                top_k=rng.choice([0, 50]), max_tokens=m, ignore_eos=True, **extras)
    return prompt, params


def _extras(rng: random.Random, vocab: int, max_tokens: int) -> dict:
    """One request in four asks for extras (log-probabilities, penalties, a logit bias, allowed tokens,
    min_tokens, bad words), so the batch keeps changing between the steps' kinds (`GraphedStep.launch_extras`) and
    the penalty rows move between slots."""
    if rng.random() >= 0.25:
        return {}
    kinds = rng.sample(["logprobs", "penalties", "bias", "allowed", "min_tokens", "bad_words"], rng.randint(1, 3))
    extras = {}
    if "logprobs" in kinds:
        extras["logprobs"] = rng.choice([0, 2, 5])
    if "penalties" in kinds:
        extras.update(repetition_penalty=rng.choice([1.1, 1.5]), frequency_penalty=rng.choice([0.0, 0.5]))
    if "bias" in kinds:
        extras["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, 5.0]) for _ in range(3)}
    if "allowed" in kinds:
        extras["allowed_token_ids"] = rng.sample(range(vocab), 8)
    if "min_tokens" in kinds:
        extras.update(min_tokens=rng.randint(0, max_tokens), stop_token_ids=[rng.randrange(vocab)])
    if "bad_words" in kinds:  # a token and two short phrases (their own graphs: `Penalties.kind`)
        extras["bad_words_token_ids"] = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 2, 3)]
    return extras


def soak_rank(rank: int, world_size: int, device, args, accept) -> None:
    """One rank of the soak (every rank runs it; rank 0 drives the traffic and writes the report)."""
    from eyas.dist.tp import TPEngine
    from eyas.loader.resolve import resolve_dtype
    dtype = resolve_dtype(args.dtype, device)
    target, tokenizer, draft, simulated = load_models(args.model, args.draft, device, dtype, rank, world_size,
                                                      args.tp_draft == "sharded")
    tree = resolve_tree(args.speculation) if draft is not None else None
    max_len = args.max_prompt + args.max_tokens + 64
    cfg = EngineConfig(max_num_seqs=args.max_batch, max_num_batched_tokens=max(2048, args.max_prompt),
                       cuda_graphs=args.cuda_graphs and device.type == "cuda", max_model_len=max_len,
                       num_blocks=args.num_blocks, scheduling_policy=args.scheduling_policy)
    engine = LLMEngine(target, tokenizer, draft, tree, cfg)
    if simulated and tree is not None:
        simulate_acceptance(engine, accept)
    tp = TPEngine(engine, rank, world_size, check=world_size > 1)
    vocab = target.config.vocab_size
    if rank != 0:
        while tp.step() is not None:
            pass
        return
    rng = random.Random(args.seed)
    report = {"model": args.model, "tensor_parallel": world_size, "tp_draft": args.tp_draft,
              "speculation": args.speculation, "scheduling_policy": args.scheduling_policy,
              "simulated_acceptance": simulated, "cuda_graphs": cfg.cuda_graphs, "duration_s": args.duration,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    live: set[str] = set()
    admitted = finished = aborted = refused = tokens = steps = 0
    batch_seen: dict[int, int] = {}
    step_ms: list[float] = []
    s0 = time.monotonic()
    tp.step()  # an idle step: the ranks meet once (each has loaded its shard) before the traffic's clock starts
    report["startup_s"] = time.monotonic() - s0
    t0 = last_report = time.monotonic()
    burst, phase_until, last_admit = False, t0, t0

    def write(final: bool) -> None:
        ms = np.array(step_ms) if step_ms else np.zeros(1)
        report.update(elapsed_s=time.monotonic() - t0, steps=steps, admitted=admitted, finished=finished,
                      aborted=aborted, refused=refused, tokens=tokens, still_running=len(live),
                      batch_sizes_seen=dict(sorted(batch_seen.items())),
                      step_ms={"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                               "max": float(ms.max())},
                      final=final)
        report["preemptions"] = engine.scheduler.num_preemptions
        if final:
            report["kv_blocks_in_use"] = engine.blocks.num_used
            report["passed"] = (not live and engine.blocks.num_used == 0 and admitted == finished + aborted
                                and steps > 0)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "soak.json").write_text(json.dumps(report, indent=2))

    from tqdm.auto import tqdm
    bar = tqdm(total=int(args.duration), unit="s", desc="soak")
    draining = False
    while True:
        now = time.monotonic()
        if not draining and now - t0 >= args.duration:
            draining = True  # admit nothing more; finish what runs, then stop every rank
        if not draining:
            if now >= phase_until:  # alternate bursts (the batch fills) and quiet spells (it drains to 1 or 0)
                burst = not burst
                phase_until = now + (rng.uniform(2, 10) if burst else rng.uniform(5, 20))
            rate = args.burst_rate if burst else args.quiet_rate  # requests per second
            expected = rate * (now - last_admit)
            last_admit = now
            k = int(expected) + (rng.random() < expected - int(expected))
            for _ in range(min(k, 2 * args.max_batch - len(live))):  # a bounded queue
                prompt, params = _request(rng, vocab, max_len, args.max_prompt, args.max_tokens,
                                          args.scheduling_policy == "priority")
                live.add(tp.add_request(prompt, params))
                admitted += 1
            if live and rng.random() < 0.01:
                tp.abort(rng.choice(sorted(live)))
        elif not live:
            tp.stop()
            tp.step()
            break
        if not live:
            time.sleep(0.001)  # idle: every rank still steps (and receives the next requests), without spinning
        s0 = time.perf_counter()
        outs = tp.step()
        step_ms.append((time.perf_counter() - s0) * 1000)
        steps += 1
        batch_seen[len(outs)] = batch_seen.get(len(outs), 0) + 1  # requests that got tokens at this step
        for rid, _ in tp.last_errors:
            live.discard(rid)
            admitted -= 1
            refused += 1
        for o in outs:
            tokens += len(o.new_token_ids)
            if o.finished:
                live.discard(o.request_id)
                if o.finish_reason == "abort":
                    aborted += 1
                else:
                    finished += 1
        for rid in list(live):  # an abort of a request still waiting returns no output: count it here
            if rid not in engine.seqs:
                live.discard(rid)
                aborted += 1
        if now - last_report >= args.report_every:
            write(False)
            bar.update(int(now - t0) - bar.n)
            bar.set_postfix(steps=steps, running=len(live), done=finished, aborted=aborted)
            last_report = now
    bar.close()
    write(True)
    print(json.dumps(report, indent=2))
    if not report["passed"]:
        raise RuntimeError(f"soak failed: {report}")


def run(args) -> int:
    from eyas.loader.resolve import resolve_device
    if args.duration <= 0 or args.max_batch < 1 or args.max_tokens < 1 or args.max_prompt < 1:
        raise SystemExit("eyas bench soak: --duration, --max-batch, --max-tokens and --max-prompt must be positive")
    if args.tensor_parallel < 1:
        raise SystemExit("eyas bench soak: --tensor-parallel must be >= 1")
    try:
        resolve_tree(args.speculation)
        accept = parse_acceptance(args.accept_ranks, args.accept_rates)
    except ValueError as e:
        raise SystemExit(f"eyas bench soak: {e}") from None
    device = resolve_device(args.device)
    W = args.tensor_parallel
    if W == 1:
        soak_rank(0, 1, device, args, accept)
        return 0
    from eyas.dist.launch import run_ranks
    run_ranks(soak_rank, W, args, accept, on_gpu=device.type == "cuda", timeout=args.duration + args.grace)
    report = json.loads((Path(args.out) / "soak.json").read_text())
    return 0 if report.get("passed") else 1


def add_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser("soak", help="random traffic for a while: no deadlock, no lost request, no leaked block")
    p.add_argument("--model", default="llama-3.1-8b-shape", help="a checkpoint, or a random-weight shape")
    p.add_argument("--draft", default="auto")
    p.add_argument("--speculation", default="dispatch:1=tree:smollm2_48d5,4=chain:3,24=plain",
                   help="chain:K, tree:NAME or dispatch:B1=SPEC,... (a tree per batch size)")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--tp-draft", choices=["sharded", "replicated"], default="sharded",
                   help="with --tensor-parallel: the draft sharded like the target, or whole on every rank")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (then the running requests "
                                                                 "finish)")
    p.add_argument("--grace", type=float, default=600.0, help="seconds after --duration at which every rank is killed")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from free memory)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: each request gets a random priority in 0..3 (eyas.engine.scheduler)")
    p.add_argument("--accept-ranks", default=None, help="random-weight shapes: rank paths to replay "
                                                        "(as in bench latency)")
    p.add_argument("--accept-rates", default="0.8,0.7,0.6",
                   help="random-weight shapes without --accept-ranks: per-depth rates, or a tpc.json (as in bench "
                        "latency)")
    p.add_argument("--burst-rate", type=float, default=100.0, help="requests per second during a burst")
    p.add_argument("--quiet-rate", type=float, default=0.5, help="requests per second between bursts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-every", type=float, default=30.0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--out", default="bench-out/soak")
    p.set_defaults(func=run)
    return p
