"""Two settings of this tree side by side in one process: the ext_proc servicer fed Envoy's messages.

    .venv/bin/python bench/inproc_ab.py --api responses --vs-api chat        # Responses against chat
    .venv/bin/python bench/inproc_ab.py --api responses --toggle lever.py    # a lever off against on

No transport, no Envoy, no producer: ``ExternalProcessor.serve_stream`` of one filter (qwen3 +
hermes, the lean path) is handed the messages Envoy would send it, serialized and parsed as on the
wire, for ``--streams`` interleaved reasoning + tool-call streams of ``--tokens`` tokens (one
message of each stream in turn, as paced streams arrive), and its replies are serialized. A round
runs both settings one after the other on the same streams (A first in even rounds, B in odd); the figure is the ratio of
their CPU per token within a round, whose median over ``--rounds`` rounds is given with the
spread, beside each setting's median and least CPU per token.

``--evict-mb N``: every ``--evict-every`` messages handed (default 6, about what a paced worker takes
a wake-up), N MiB are written through, one byte a cache line, so that the next messages find their
streams' objects and the code out of the caches, as the paced server's wake-ups do (its last-level
cache is 32 MiB here: 64 evicts all of it; the writing's CPU is not counted). Without it the
streams run with hot caches, which the server never has: a lever that touches less memory shows
here, one that only saves instructions shows without it.

This is steadier than ``paced_ab.py`` (separate processes, minutes apart) on this shared machine,
where one process's CPU per token can move by 1.5x between runs: the two settings share every
slow spell but the ones shorter than a round (about 0.1 s at 16 streams of 100 tokens). Use it to
find where a cost sits and which lever is worth a paced run; ``paced_ab.py`` (the whole path,
transport and Envoy included) decides what is kept.

``bench/delta_models_ab.py`` did this for one lever through the exchange; this takes any lever, or
two APIs, through the servicer.

``--toggle FILE``: a Python file defining ``on()`` and ``off()``, which switch the lever (patch a
method, a flag); setting A is ``off()``, B is ``on()``. ``bench/toggles/`` keeps the ones a measurement in
``docs/performance.md`` names. ``--vs-api``: setting A is that API, B is
``--api``, lever-free.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import profile_hot_path
import streams


def script(api: str, frames: list[bytes]) -> list[bytes]:
    """Envoy's messages for one stream of ``api``: the request, the producer's answer, its end."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    def headers(kind: str, pairs: dict[str, str]) -> bytes:
        message = pb.HttpHeaders()
        for key, value in pairs.items():
            message.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
        return pb.ProcessingRequest(**{kind: message}).SerializeToString()

    def body(kind: str, data: bytes, end: bool) -> bytes:
        return pb.ProcessingRequest(**{kind: pb.HttpBody(body=data, end_of_stream=end)}).SerializeToString()

    chat = streams.chat_request("qwen3", tools=True)
    request = json.dumps(chat if api == "chat" else streams.agent_request(chat, api)).encode()
    return [
        headers("request_headers", {":method": "POST", ":path": streams.API_PATHS[api], ":authority": "bench",
                                    "content-type": "application/json"}),
        body("request_body", request, True),
        headers("response_headers", {":status": "200", "content-type": "text/event-stream"}),
        *(body("response_body", frame, False) for frame in frames),
        body("response_body", b"", True),
    ]


class Evict:
    """Writes one byte in every cache line of ``mib`` MiB every ``every`` calls of ``tick``; ``spent``:
    the CPU seconds that took (taken off the measured cost)."""

    def __init__(self, mib: int, every: int) -> None:
        self.buffer = bytearray(mib << 20)
        self.line = bytes(len(self.buffer[::64]))
        self.every, self.count, self.spent = max(1, every), 0, 0.0

    def tick(self) -> None:
        if not self.buffer:
            return
        self.count += 1
        if self.count % self.every == 0:
            start = time.process_time()
            self.buffer[::64] = self.line
            self.spent += time.process_time() - start


async def batch(processor: Any, messages: list[bytes], streams_n: int, evict: Evict | None = None) -> int:
    """``streams_n`` streams of ``messages`` through ``processor``, one message of each in turn
    (``evict.tick()`` before each); the bytes of the replies."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from grpc.aio import EOF

    queues = [collections.deque(messages) for _ in range(streams_n)]
    waiting: dict[int, asyncio.Future] = {}
    sent = [0]

    def stream(i: int) -> Any:
        async def read() -> Any:
            future = asyncio.get_running_loop().create_future()
            waiting[i] = future
            return await future

        async def write(reply: Any) -> None:
            sent[0] += len(reply.SerializeToString())

        return processor.serve_stream(read, write, True)

    tasks = [asyncio.ensure_future(stream(i)) for i in range(streams_n)]
    while any(queues) or waiting:
        for i in range(streams_n):
            while i not in waiting and not tasks[i].done():
                await asyncio.sleep(0)
            future = waiting.pop(i, None)
            if future is not None:
                if evict is not None:
                    evict.tick()
                queue = queues[i]
                future.set_result(pb.ProcessingRequest.FromString(queue.popleft()) if queue else EOF)
        await asyncio.sleep(0)
        if all(task.done() for task in tasks):
            break
    await asyncio.gather(*tasks)
    return sent[0]


def load_toggle(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("inproc_toggle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def run(args: argparse.Namespace, model_dir: str, model: Any) -> list[str]:
    from derender.endpoints.router import Router
    from derender.extproc.server import ExternalProcessor
    from derender.routing.producer import Producer

    producer = Producer("http://127.0.0.1:9")  # never reached: the messages carry the producer's answer
    processor = ExternalProcessor(Router(model, producer, None, None))
    frames = profile_hot_path.events(streams.reasoning_tool_call(model_dir, args.tokens))
    toggle = load_toggle(args.toggle) if args.toggle else None
    a_api = args.vs_api or args.api
    a_messages, b_messages = script(a_api, frames), script(args.api, frames)

    def setting(which: str) -> list[bytes]:
        if toggle is not None:
            (toggle.on if which == "B" else toggle.off)()
        return b_messages if which == "B" else a_messages

    for which in ("A", "B", "A", "B"):  # warm-up: every code path and cache once
        await batch(processor, setting(which), args.streams)
    tokens = args.streams * args.tokens
    evict = Evict(args.evict_mb, args.evict_every)
    a_us, b_us, ratios = [], [], []
    for round_ in range(args.rounds):
        costs = {}
        for which in ("A", "B") if round_ % 2 == 0 else ("B", "A"):  # neither always first
            messages = setting(which)
            evict.spent = 0.0
            start = time.process_time()
            await batch(processor, messages, args.streams, evict)
            costs[which] = (time.process_time() - start - evict.spent) / tokens * 1e6
        a_us.append(costs["A"])
        b_us.append(costs["B"])
        ratios.append(costs["B"] / costs["A"])
    if toggle is not None:
        toggle.off()
    await producer.close()
    a_name = f"{a_api}, lever off" if toggle else a_api
    b_name = f"{args.api}, lever on ({Path(args.toggle).name})" if toggle else args.api
    spread = sorted(ratios)
    return [
        f"`.venv/bin/python bench/inproc_ab.py {' '.join(sys.argv[1:])}`: {args.streams} interleaved qwen3 + hermes "
        f"streams of {args.tokens} tokens through `serve_stream` (no transport), {args.rounds} rounds"
        + (f", {args.evict_mb} MiB written through every {args.evict_every} messages (not counted)." if args.evict_mb else "."),
        "",
        "| setting | CPU us/token, median round | least |",
        "|---|---:|---:|",
        f"| A: {a_name} | {statistics.median(a_us):.1f} | {min(a_us):.1f} |",
        f"| B: {b_name} | {statistics.median(b_us):.1f} | {min(b_us):.1f} |",
        "",
        f"B / A within a round: median **{statistics.median(ratios):.3f}x**, middle half "
        f"{spread[len(spread) // 4]:.3f}-{spread[(3 * len(spread)) // 4]:.3f}x, all {spread[0]:.2f}-{spread[-1]:.2f}x; "
        f"least against least {min(b_us) / min(a_us):.3f}x.",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", choices=list(streams.API_PATHS), default="chat", help="setting B's API (and A's, with --toggle)")
    parser.add_argument("--vs-api", choices=list(streams.API_PATHS), default=None, help="setting A: this API, lever-free")
    parser.add_argument("--toggle", default=None, help="a file with on() and off(): setting A off, B on")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--evict-mb", type=int, default=0, help="MiB written through every --evict-every messages: "
                        "the caches as a paced server's wake-ups find them (default 0: hot caches)")
    parser.add_argument("--evict-every", type=int, default=6, help="messages between two evictions (default 6)")
    args = parser.parse_args()
    if bool(args.vs_api) == bool(args.toggle):
        parser.error("give one of --vs-api and --toggle")
    from derender.ops import assets

    model_dir = str(assets.fetch("qwen3", quiet=True))
    model = profile_hot_path.hermes_model(model_dir)  # before the loop: it runs vLLM's own setup loop
    print("\n".join(asyncio.run(run(args, model_dir, model))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
