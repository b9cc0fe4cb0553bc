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
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import procs  # noqa: E402
from derender.routing.kvfeed import FeedSpec  # noqa: E402
from derender.routing.kvroute import KvRouting  # noqa: E402
from derender.routing.prefix import BlockHasher  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher  # noqa: E402


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


async def run(args: argparse.Namespace) -> dict:
    import subprocess

    folder = tempfile.mkdtemp(prefix="derender-kv-bench-")
    argv = [sys.executable, __file__, "--publish", folder, *sys.argv[1:]]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # The feeds as kv-events routing makes them: each stored block also named for the prompts' lookup
    # (``KvRouting.learn``), its flood limit lifted.
    routing = KvRouting(BlockHasher(16), [FeedSpec(f"10.0.0.{i}:8000", f"ipc://{folder}/pub{i}",
                                                   f"ipc://{folder}/replay{i}") for i in range(args.replicas)])
    index, feeds = routing.index, list(routing.feeds.values())
    for feed in feeds:
        feed.max_rate = 1e9
    await asyncio.sleep(3.0)  # the publishers bound (vLLM imported there)
    for feed in feeds:
        feed.start()
    await asyncio.sleep(1.5)  # subscribed
    assert child.stdin is not None and child.stdout is not None
    cpu0, wall0 = time.thread_time(), time.monotonic()
    child.stdin.write("go\n")
    child.stdin.flush()
    line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
    cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
    for feed in feeds:
        await feed.stop()
    child.wait(10)
    applied = sum(f.next_seq or 0 for f in feeds)
    return {"events": int(line), "batches": applied, "cpu_s": cpu, "wall_s": wall, "index_entries": len(index)}


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
    r = asyncio.run(run(args))
    share = r["cpu_s"] / r["wall_s"]
    lines = [
        "# KV cache events: what reading them costs a worker",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; command: `.venv/bin/python bench/kv_events.py "
        f"--rate {args.rate:g} --seconds {args.seconds:g} --replicas {args.replicas}` ({os.cpu_count()} CPUs)",
        f"- {args.replicas} of vLLM's publishers (`ZmqEventPublisher`, on their threads) send {r['events']} events in "
        f"{r['batches']} batches ({args.events_per_batch} events a batch: BlockStored of {args.blocks} blocks, and "
        f"BlockRemoved once a replica's {args.cache_blocks} blocks are full) over {r['wall_s']:.1f} s",
        "",
        f"| events/s | loop thread CPU s | share of one core | us per event | index entries at the end |",
        "|---:|---:|---:|---:|---:|",
        f"| {r['events'] / r['wall_s']:.0f} | {r['cpu_s']:.2f} | {share * 100:.2f} % | "
        f"{r['cpu_s'] / max(1, r['events']) * 1e6:.2f} | {r['index_entries']} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
