"""What reading the producers' KV cache events costs a filter worker: the CPU of a worker's event loop
while vLLM's own publisher (``ZmqEventPublisher``) sends it ``--rate`` events a second.

The publishers in a process of their own (as in vLLM's engines: ``ZmqEventPublisher`` on its thread),
the filter's feeds (``routing.kvfeed``: a SUB socket, vLLM's msgpack decoder, the ``KvIndex``, and each
stored block named for the prompts' lookup, ``KvRouting.learn``) on this process's asyncio loop, as in a
worker. Each batch holds
``--events-per-batch`` events as a busy engine step does: BlockStored of ``--blocks`` new blocks each,
and as many BlockRemoved once the replica's cache (``--cache-blocks``) is full. Reported: the loop
thread's CPU seconds over the run's wall seconds (its share of one core), and per event; the index's
size at the end. Several replicas: ``--replicas`` publishers and feeds, the rate split among them.

    .venv/bin/python bench/kv_events.py [--rate 10000] [--seconds 10] [--out bench/KV_EVENTS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import procs  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher  # noqa: E402

from derender.extproc import workers  # noqa: E402
from derender.routing import kvhub  # noqa: E402
from derender.routing.kvfeed import FeedSpec  # noqa: E402
from derender.routing.kvroute import KvRouting  # noqa: E402
from derender.routing.prefix import BlockHasher  # noqa: E402


def publish(publisher: ZmqEventPublisher, events_per_s: float, args: argparse.Namespace, stop: threading.Event,
            seed: int) -> int:
    """Events at ``events_per_s``, in batches; the count sent."""
    rng = random.Random(seed)
    cached: list[int] = []
    sent, began = 0, time.monotonic()
    while not stop.is_set():
        events: list = []
        for _ in range(args.events_per_batch):
            new = [rng.getrandbits(63) for _ in range(args.blocks)]
            cached += new
            events.append(BlockStored(block_hashes=new, parent_block_hash=None,
                                      token_ids=[rng.randrange(150000) for _ in range(16 * args.blocks)],
                                      block_size=16, lora_id=None, medium="GPU", lora_name=None))
            if len(cached) > args.cache_blocks:
                gone, cached[:] = cached[: args.blocks], cached[args.blocks :]
                events.append(BlockRemoved(block_hashes=gone, medium="GPU"))
        publisher.publish(KVEventBatch(ts=time.time(), events=events))
        sent += len(events)
        ahead = sent / events_per_s - (time.monotonic() - began)
        if ahead > 0:
            time.sleep(ahead)
    return sent


def publishers(args: argparse.Namespace, folder: str) -> None:
    """The publishing process: waits for a line on stdin, publishes for ``--seconds``, prints the count."""
    pubs = [ZmqEventPublisher(0, endpoint=f"ipc://{folder}/pub{i}", replay_endpoint=f"ipc://{folder}/replay{i}",
                              hwm=1_000_000) for i in range(args.replicas)]
    sys.stdin.readline()
    stop = threading.Event()
    counts: list[int] = []
    threads = [threading.Thread(target=lambda p=p, i=i: counts.append(publish(p, args.rate / args.replicas, args, stop, i)))
               for i, p in enumerate(pubs)]
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    time.sleep(0.5)
    print(sum(counts), flush=True)
    for p in pubs:
        p.shutdown()


async def run(args: argparse.Namespace, hub: tuple[str, int] | None) -> dict:
    """One run: the worker's feeds reading the events themselves, or a hub process (``hub``: its
    socket and pid) reading them and relaying them to the worker (``routing.kvhub``), as ``derender
    serve`` does."""
    import subprocess

    import psutil

    from derender.ops import metrics

    folder = tempfile.mkdtemp(prefix="derender-kv-bench-")
    argv = [sys.executable, __file__, "--publish", folder, *sys.argv[1:]]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    specs = [FeedSpec(f"10.0.0.{i}:8000", f"ipc://{folder}/pub{i}", f"ipc://{folder}/replay{i}")
             for i in range(args.replicas)]
    hub_pid = hub[1] if hub else None
    # The feeds as kv-events routing makes them: each stored block also named for the prompts' lookup.
    routing = KvRouting(BlockHasher(16), specs, hub=hub[0] if hub else None)
    index = routing.index
    await asyncio.sleep(3.0)  # the publishers bound (vLLM imported there)
    routing.start()
    await asyncio.sleep(1.5)  # subscribed
    assert child.stdin is not None and child.stdout is not None
    hub_proc = psutil.Process(hub_pid) if hub_pid else None
    hub0 = procs.cpu_of(hub_proc) if hub_proc else 0.0
    cpu0, wall0 = time.thread_time(), time.monotonic()
    child.stdin.write("go\n")
    child.stdin.flush()
    line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
    cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
    hub_cpu = procs.cpu_of(hub_proc) - hub0 if hub_proc else 0.0
    applied = sum(metrics.REGISTRY.get_sample_value("derender_kv_index_batches_total", {"replica": s.replica}) or 0
                  for s in specs)
    await routing.stop()
    child.wait(10)
    return {"events": int(line), "batches": applied, "cpu_s": cpu, "wall_s": wall, "index_entries": len(index),
            "hub_cpu_s": hub_cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10_000, help="events a second, all replicas together")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--events-per-batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4, help="blocks per BlockStored")
    parser.add_argument("--cache-blocks", type=int, default=50_000, help="each replica's cache, in blocks")
    parser.add_argument("--out", default="-")
    parser.add_argument("--publish", help=argparse.SUPPRESS)  # the publishing process's folder
    args = parser.parse_args()
    if args.publish:
        publishers(args, args.publish)
        return 0
    gc.freeze()  # as derender serve does once the model is loaded
    runs = {}
    for mode in ("alone", "hub"):
        before = {s: metrics_value(s) for s in range(args.replicas)}
        hub = None
        if mode == "hub":  # forked before this process's loop runs, as derender serve does
            path, sock = kvhub.listen()
            hub = (path, workers.fork_helper("kv-events hub", lambda sock=sock: kvhub.Hub().serve(sock)))
            sock.close()
        loop = workers.new_event_loop()  # a worker's loop (uvloop)
        runs[mode] = loop.run_until_complete(run(args, hub))
        loop.close()
        if hub:
            os.kill(hub[1], signal.SIGTERM)
            os.waitpid(hub[1], 0)
        runs[mode]["batches"] -= sum(before.values())
    first = runs["alone"]
    lines = [
        "# KV cache events: what reading them costs a worker",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; command: `.venv/bin/python bench/kv_events.py "
        f"--rate {args.rate:g} --seconds {args.seconds:g} --replicas {args.replicas} --events-per-batch "
        f"{args.events_per_batch} --blocks {args.blocks}` ({os.cpu_count()} CPUs)",
        f"- {args.replicas} of vLLM's publishers (`ZmqEventPublisher`, on their threads) send about {first['events']} "
        f"events in {first['batches']:.0f} batches a run ({args.events_per_batch} events a batch: BlockStored of "
        f"{args.blocks} blocks, and BlockRemoved once a replica's {args.cache_blocks} blocks are full) over "
        f"{first['wall_s']:.1f} s",
        "- alone: the worker's own feeds read and decode the events and name the blocks (no hub, or the hub is gone);"
        " hub: `derender serve`'s way, a hub process reads them once and relays them to the workers"
        " (`routing/kvhub.py`); the worker applies what it relays",
        "",
        "| reader | events/s | worker loop CPU s | worker: share of one core | worker: us per event | hub process: share "
        "of one core | hub: us per event | index entries at the end |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in runs.items():
        share = r["cpu_s"] / r["wall_s"]
        hub = (f"{r['hub_cpu_s'] / r['wall_s'] * 100:.2f} % | {r['hub_cpu_s'] / max(1, r['events']) * 1e6:.2f}"
               if mode == "hub" else "- | -")
        lines.append(f"| {mode} | {r['events'] / r['wall_s']:.0f} | {r['cpu_s']:.2f} | {share * 100:.2f} % | "
                     f"{r['cpu_s'] / max(1, r['events']) * 1e6:.2f} | {hub} | {r['index_entries']} |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        procs.write_report(lines, args.out)
    return 0


def metrics_value(i: int) -> float:
    from derender.ops import metrics

    return metrics.REGISTRY.get_sample_value("derender_kv_index_batches_total", {"replica": f"10.0.0.{i}:8000"}) or 0


if __name__ == "__main__":
    raise SystemExit(main())
