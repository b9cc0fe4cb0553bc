"""Prefix-cache-aware routing across producer replicas: least-request vs prefix vs precise vs kv-events.

Each routing mode gets a fresh ``derender up --replicas 4 --routing MODE`` (the real Envoy, the
filter, four simulators modelling vLLM's prefix cache: an LRU of chained 16-token blocks, prefill
time for the uncached tokens only, ``cached_tokens`` in usage) and the same multi-turn workload:
``--conversations`` conversations of ``--turns`` turns in ``--tenants`` tenants, each tenant with
its own ~``--system-tokens``-token system prompt, user messages of 50-200 tokens (the simulator
answers each by echoing it: answers of 50-200 tokens), ``--concurrency`` conversations in flight,
so turns of different conversations interleave. A fourth run, ``ideal``, sends the workload to one
replica with a cache that never evicts: the hit rate no routing over several replicas can beat.

Reported per mode: the prefix-cache hit rate (cached / prompt tokens, from the simulators' own
counts) and its share of the ideal; time to first token p50 / p99 at the client (the simulator's
prefill model makes a miss cost ``--prefill-us-per-token`` per uncached token); requests per
replica, max over mean; and the filter's CPU per routing decision (its request log's
``routing_us``: thread CPU time of the decision, key hashing included).

    .venv/bin/python bench/prefix_routing.py [--out bench/PREFIX.md]
"""

from __future__ import annotations

import argparse
import collections
import asyncio
import datetime
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import aiohttp  # noqa: E402
import procs  # noqa: E402
from derender.ops import assets  # noqa: E402

# name: (routing, the filter's --workers, replicas, more flags of derender up); None: the command line's
MODES = {
    "least-request": ("least-request", None, None, []),
    "prefix": ("prefix", None, None, []),
    # The other choice of key: at most 48 blocks (768 tokens), inside every tenant's system prompt,
    # so all of a tenant's conversations share one key.
    "prefix, tenant key": ("prefix", None, None, ["--prefix-key-blocks", "48"]),
    "precise": ("precise", None, None, []),
    "precise 1 worker": ("precise", 1, None, []),
    # The replicas' own KV cache events (the simulators publish as vllm serve --kv-events-config does).
    "kv-events": ("kv-events", None, None, []),
    "kv-events 1 worker": ("kv-events", 1, None, []),
    # Two filter processes behind Envoy (filter replicas): each counts only its own requests in flight.
    "kv-events 2 filters": ("kv-events", 1, None, ["--filters", "2"]),
    "ideal": ("least-request", None, 1, []),
}
WORDS = ("account billing invoice region quarter revenue margin forecast staffing vendor contract renewal "
         "shipment warehouse latency outage incident ticket customer refund policy audit compliance budget "
         "roadmap feature release migration database cluster replica cache throughput capacity").split()


def workload(args: argparse.Namespace) -> list[dict]:
    """The conversations: tenant, system prompt, and each turn's user message (fixed by the seed)."""
    rng = random.Random(args.seed)
    systems = []
    for t in range(args.tenants):
        words = [rng.choice(WORDS) for _ in range(int(args.system_tokens * 0.75))]
        systems.append(f"You are the assistant of tenant {t}. Follow the policies below.\n" + " ".join(words))
    conversations = []
    for c in range(args.conversations):
        tenant = c % args.tenants
        turns = [f"[{c}.{k}] " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160))) for k in range(args.turns)]
        conversations.append({"id": c, "tenant": tenant, "system": systems[tenant], "turns": turns})
    rng.shuffle(conversations)
    return conversations


async def run_conversation(http: aiohttp.ClientSession, url: str, conv: dict, ttfts: list[float], failures: list[str],
                           turned=None) -> None:
    messages = [{"role": "system", "content": conv["system"]}]
    for user in conv["turns"]:
        messages.append({"role": "user", "content": user})
        body = {"model": "qwen3", "messages": messages, "max_tokens": 400, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.monotonic()
        first = None
        text = []
        async with http.post(url, json=body) as response:
            if response.status != 200:
                failures.append(f"{response.status}: {(await response.text())[:200]}")
                return
            buffer = b""
            async for data in response.content.iter_any():
                if first is None:
                    first = time.monotonic() - start
                buffer += data
            for line in buffer.split(b"\n\n"):
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    for choice in event.get("choices") or ():
                        text.append(choice.get("delta", {}).get("content") or "")
        ttfts.append(first if first is not None else float("nan"))
        messages.append({"role": "assistant", "content": "".join(text)})
        if turned is not None:
            await turned(http)


async def drive(url: str, conversations: list[dict], concurrency: int, sims: list[str] = (),
                resets: int = 0) -> tuple[list[float], list[str], float]:
    """The conversations, ``concurrency`` at a time; with ``resets``, that many prefix-cache resets spread
    evenly over the run (vLLM's ``POST /reset_prefix_cache``, as a restart empties a cache: the replicas
    in turn), which only the replicas' own events tell the filter of."""
    ttfts: list[float] = []
    failures: list[str] = []
    queue = list(conversations)
    total = sum(len(c["turns"]) for c in conversations)
    done = [0, 0]  # turns answered, resets made

    async def turned(http: aiohttp.ClientSession) -> None:
        done[0] += 1
        if done[1] < resets and done[0] >= total * (done[1] + 1) / (resets + 1):
            replica = sims[done[1] % len(sims)]
            done[1] += 1
            async with http.post(replica + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def worker() -> None:
            while queue:
                await run_conversation(http, url, queue.pop(0), ttfts, failures, turned if resets else None)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttfts, failures, time.monotonic() - start


def one_mode(args: argparse.Namespace, mode: str, conversations: list[dict]) -> dict:
    port = procs.free_port()
    routing, workers, replicas, more = MODES[mode]
    replicas = replicas or args.replicas
    blocks = 1 << 30 if mode == "ideal" else args.cache_blocks
    argv = [procs.PYTHON, "-m", "derender.cli", "up", "--port", str(port), "--replicas", str(replicas),
            "--routing", routing, "--workers", str(workers or args.workers), *more,
            f"--sim-arg=--prefix-cache-blocks={blocks}", f"--sim-arg=--prefill-us-per-token={args.prefill_us_per_token}",
            f"--sim-arg=--delay={args.delay}", f"--sim-arg=--tokens-per-event={args.tokens_per_event}",
            "--sim-arg=--enable-prompt-tokens-details"]
    up = procs.Proc("prefix-" + "".join(c if c.isalnum() else "-" for c in mode), argv).start()
    try:
        up.wait(lambda: "endpoint ready" in up.log.read_text(errors="replace"), 300)
        line = re.search(r"producer (http://\S+)", up.log.read_text(errors="replace"))
        sims = line.group(1).split(",") if line else []
        resets = 0 if mode == "ideal" else args.resets
        ttfts, failures, wall = asyncio.run(drive(f"http://127.0.0.1:{port}/v1/chat/completions", conversations,
                                                  args.concurrency, sims, resets))
        stats = [procs.get_json(u + "/sim/stats") for u in sims]
        log = up.log.read_text(errors="replace")
    finally:
        up.stop()
    received = [s["received"] for s in stats]
    prompt = sum(s["prompt_tokens"] for s in stats)
    cached = sum(s["cached_prompt_tokens"] for s in stats)
    routing_us = [float(x) for x in re.findall(r"routing_us=([\d.]+)", log)]
    decisions = collections.Counter(re.findall(r" route=(\w+)", log))
    out = {
        "requests": sum(received),
        "failed": len(failures),
        "failures": failures[:3],
        "wall_s": wall,
        "per_replica": received,
        "max_over_mean": max(received) / statistics.mean(received) if received and sum(received) else float("nan"),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else float("nan"),
        "client_ttft_p50": procs.pct(ttfts, 0.5),
        "client_ttft_p99": procs.pct(ttfts, 0.99),
        "ttft_p50": procs.pct([w for s in stats for w in s["prefill_waits"]], 0.5),
        "ttft_p99": procs.pct([w for s in stats for w in s["prefill_waits"]], 0.99),
        "routing_us_mean": statistics.mean(routing_us) if routing_us else None,
        "decisions": dict(decisions),  # precise, kv-events: match, bound, key
        "routing_us_p50": procs.pct(routing_us, 0.5) if routing_us else None,
        "routing_us_p99": procs.pct(routing_us, 0.99) if routing_us else None,
    }
    print(f"[{mode}] hit rate {out['hit_rate'] * 100:.1f} %, TTFT p50 {out['ttft_p50'] * 1e3:.0f} ms, "
          f"p99 {out['ttft_p99'] * 1e3:.0f} ms (client {out['client_ttft_p50'] * 1e3:.0f} / "
          f"{out['client_ttft_p99'] * 1e3:.0f} ms), per replica {received}, routing {out['routing_us_mean']} us, "
          f"failed {len(failures)}", file=sys.stderr, flush=True)
    return out


def stored_event(kv, replica: str, ids: list[int]) -> None:
    """What a replica publishes once it has prefilled ``ids``: vLLM's hashes of its full blocks (the
    producer's work, outside the decision's time), read as a feed reads it."""
    from derender.routing.kvindex import external
    from vllm.distributed.kv_events import BlockStored

    hashes = [external(h) for h in kv.hasher.chain(ids)]
    size = kv.hasher.block_size
    event = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=ids[: len(hashes) * size],
                        block_size=size, lora_id=None, medium="GPU", lora_name=None)
    kv.apply(replica, [event])


def routing_cost(conversations: list[dict], repeats: int = 5) -> dict:
    """The routing decision alone, in this process (one worker's view), on the workload's prompts as
    the filter renders them (Qwen3's chat template; each answer the echo of its question, as the
    simulator answers): CPU microseconds per request, first turns and later turns apart."""
    from derender.routing.balance import RoutingSpec
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets.fetch("qwen3", quiet=True)))
    prompts = []  # (turn, ids) in the order a run with these conversations interleaved sends them
    for conv in conversations:
        messages = [{"role": "system", "content": conv["system"]}]
        for k, user in enumerate(conv["turns"]):
            messages.append({"role": "user", "content": user})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append((k, tokenizer.encode(text, add_special_tokens=False)))
            messages.append({"role": "assistant", "content": user})
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i][0], i))  # turn by turn, across conversations
    out = {}
    urls = [f"http://10.0.0.{n}:8000" for n in range(4)]
    for mode in ("prefix", "precise", "kv-events"):
        runs = []
        for _ in range(repeats):  # each with a fresh balancer (its memos empty); the median run is reported
            spec = RoutingSpec(mode, kv_events=(":5557",))
            balancer = spec.balancer(tokenizer, None, urls)
            first, later = [], []
            for n, i in enumerate(order):
                turn, ids = prompts[i]
                began = time.thread_time()
                _, decision = balancer.route(ids)
                served = decision.chosen or f"10.0.0.{n % 4}:8000"
                balancer.started(decision, served, 200)
                balancer.finished(decision)
                (first if turn == 0 else later).append((time.thread_time() - began) * 1e6)
                if balancer.kv is not None:  # the replica's events: it stored the prompt's blocks
                    stored_event(balancer.kv, served, ids)
            runs.append({"mean": statistics.mean(first + later), "median": statistics.median(first + later),
                         "first_turns": statistics.mean(first),
                         "later_turns": statistics.mean(later),
                         "prompt_tokens_mean": statistics.mean(len(p) for _, p in prompts)})
        runs.sort(key=lambda r: r["mean"])
        out[mode] = {**runs[len(runs) // 2], "runs_mean": [r["mean"] for r in runs]}
        print(f"[in process] {mode}: {out[mode]['mean']:.0f} us per request, median {out[mode]['median']:.0f} "
              f"(first turns {out[mode]['first_turns']:.0f}, "
              f"later {out[mode]['later_turns']:.0f})", file=sys.stderr, flush=True)
    return out


def report(args: argparse.Namespace, results: dict) -> str:
    ideal = results["ideal"]["hit_rate"]
    lr = results["least-request"]["ttft_p50"]
    rows = []
    for mode in MODES:
        r = results[mode]
        cpu = "-" if r["routing_us_mean"] is None else f"{r['routing_us_mean']:.0f} / {r['routing_us_p99']:.0f}"
        rows.append(
            f"| {mode} | {r['hit_rate'] * 100:.1f} % | {r['hit_rate'] / ideal * 100:.0f} % | {r['ttft_p50'] * 1e3:.0f} | "
            f"{r['ttft_p99'] * 1e3:.0f} | {lr / r['ttft_p50']:.2f}x | {r['client_ttft_p50'] * 1e3:.0f} / "
            f"{r['client_ttft_p99'] * 1e3:.0f} | {' / '.join(map(str, r['per_replica']))} | "
            f"{r['max_over_mean']:.2f} | {cpu} | {r['failed']} |"
        )
    cost = results.get("in_process", {})
    targets = []
    for mode, share in (("prefix", 0.85), ("precise", 0.95), ("kv-events", 0.98), ("kv-events 1 worker", 0.98),
                        ("kv-events 2 filters", 0.98)):
        r = results.get(mode)
        if r is None:
            continue
        targets.append(f"- `{mode}`: {r['hit_rate'] / ideal * 100:.0f} % of the ideal hit rate (target >= {share * 100:.0f} %): "
                       f"{'met' if r['hit_rate'] / ideal >= share else '**not met**'}; max/mean requests per replica "
                       f"{r['max_over_mean']:.2f} (target <= 1.3): {'met' if r['max_over_mean'] <= 1.3 else '**not met**'}; "
                       f"TTFT p50 {lr / r['ttft_p50']:.2f}x better than least-request (target >= 2x): "
                       f"{'met' if lr / r['ttft_p50'] >= 2 else '**not met**'}; routing CPU per request in process "
                       f"median {cost.get(mode.split(' ')[0], {}).get('median', 0):.0f} us (mean "
                       f"{cost.get(mode.split(' ')[0], {}).get('mean', 0):.0f}), {r['routing_us_mean'] or 0:.0f} us mean "
                       f"in the run (target <= 50 us, median): "
                       f"{'met' if cost.get(mode.split(' ')[0], {}).get('median', 1e9) <= 50 else '**not met**'}")
    return "\n".join([
        "# Prefix-cache-aware routing",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; command: "
        f"`.venv/bin/python bench/prefix_routing.py` ({os.cpu_count()} CPUs, everything on this machine)",
        f"- workload: {args.conversations} conversations x {args.turns} turns in {args.tenants} tenants, each tenant with its "
        f"own ~{args.system_tokens}-token system prompt, user messages of 50-200 tokens answered by echo (answers of "
        f"50-200 tokens), {args.concurrency} conversations in flight (turns interleave), streaming",
        f"- producers: {args.replicas} simulators in one Envoy cluster (`derender up --replicas {args.replicas}`), each with "
        f"an LRU prefix cache of {args.cache_blocks} blocks of 16 tokens, prefill {args.prefill_us_per_token:g} us per uncached "
        f"token (one prompt at a time per replica), answers in events of {args.tokens_per_event} tokens "
        f"{args.delay * 1e3:g} ms apart; the filter with `--workers {args.workers}`"
        + (f"; {args.resets} prefix-cache resets spread over each run (`POST /reset_prefix_cache`, the replicas in "
           "turn), which only the replicas' events report" if args.resets else ""),
        "- ideal: the same workload on one simulator whose cache never evicts",
        "",
        ("TTFT: each request's modelled time to first token at its replica (the prefill queue and the prefill "
         "of its uncached tokens, from the simulators' own clocks); client TTFT: first byte at the client, which "
         "on this 2-core machine is mostly everything else sharing the CPU. Routing CPU: the `routing_us` of the "
         "filter's request log (thread CPU time of each decision) during the run, where every process competes "
         "for 2 cores."),
        "",
        "| routing | hit rate | of ideal | TTFT p50 ms | TTFT p99 ms | TTFT p50 vs least-request | client TTFT p50 / p99 ms "
        "| requests per replica | max/mean | routing CPU us mean / p99 | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        *rows,
        "",
        ("The routing decision alone, in one process on the same prompts (rendered by Qwen3's template, turn by turn "
         "across conversations, answers the echo of their question), microseconds of CPU per request (the median "
         "request and the mean) of the run with the median mean of five, each with fresh memos (measured before the runs above, the machine otherwise idle):"),
        "",
        "| routing | median | mean | first turns | later turns | prompt tokens, mean | every run's mean |",
        "|---|---:|---:|---:|---:|---:|---|",
        *[f"| {m} | {c['median']:.0f} | {c['mean']:.0f} | {c['first_turns']:.0f} | {c['later_turns']:.0f} | {c['prompt_tokens_mean']:.0f} | "
          f"{' / '.join(f'{x:.0f}' for x in c['runs_mean'])} |" for m, c in cost.items()],
        "",
        "## Targets",
        "",
        *targets,
        "",
    ])


def main() -> int:
    procs.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16, help="conversations in flight")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--cache-blocks", type=int, default=8192, help="per simulated replica")
    parser.add_argument("--prefill-us-per-token", type=float, default=100.0,
                        help="the simulated GPU's prefill cost per uncached prompt token")
    parser.add_argument("--delay", type=float, default=0.03, help="seconds between the simulator's events")
    parser.add_argument("--tokens-per-event", type=int, default=16,
                        help="tokens per producer event (few events: the filter's stream work stays small, so "
                        "time to first token shows prefill and its queue, not this 2-core machine's CPU)")
    parser.add_argument("--workers", type=int, default=2, help="the filter's --workers")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--modes", default=";".join(MODES), help="semicolon-separated, of: " + "; ".join(MODES))
    parser.add_argument("--out", default=str(BENCH / "PREFIX.md"), help="report file ('-': print only)")
    parser.add_argument("--skip-cost", action="store_true", help="not the in-process routing cost")
    parser.add_argument("--cost-only", action="store_true", help="only the in-process routing cost (printed)")
    parser.add_argument("--resets", type=int, default=0,
                        help="prefix-cache resets spread over each run, the replicas in turn (not in ideal)")
    args = parser.parse_args()
    assets.fetch("qwen3", quiet=True)
    procs.LOGS.mkdir(parents=True, exist_ok=True)
    conversations = workload(args)
    results: dict = {"in_process": {} if args.skip_cost else routing_cost(conversations)}
    if args.cost_only:
        print(json.dumps(results["in_process"], indent=1))
        return 0
    for mode in args.modes.split(";"):
        results[mode] = one_mode(args, mode, conversations)
    if set(MODES) <= set(results):
        text = report(args, results)
        print(text)
        if args.out != "-":
            Path(args.out).write_text(text)
            Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    else:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
