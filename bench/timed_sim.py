"""``derender sim`` with a clock on its writes, for per-token latency.

The simulator is the project's own (``derender.sim``, unchanged); this wrapper
records ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the
machine) just before each response body write while recording is on, and serves:

    POST /bench/record   {"on": true}  start (clears), {"on": false} stop
    GET  /bench/writes   [t, ...]      the recorded write times, seconds

    python bench/timed_sim.py --model DIR --port 8100 --mode script --script FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web
from derender.ops import assets
from derender import sim

_writes: list[float] = []
_recording = False
_write = web.StreamResponse.write


async def _timed_write(self: web.StreamResponse, data) -> None:
    if _recording:
        _writes.append(time.monotonic())
    await _write(self, data)


async def record(request: web.Request) -> web.Response:
    global _recording
    _recording = bool(json.loads(await request.read()).get("on"))
    if _recording:
        _writes.clear()
    return web.Response(status=200)


async def writes(request: web.Request) -> web.Response:
    return web.json_response(_writes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sim.add_arguments(parser)
    args = parser.parse_args()
    web.StreamResponse.write = _timed_write
    tpe = str(args.tokens_per_event)
    app = sim.build_app(
        args.model or str(assets.fetch("qwen3", quiet=True)),
        mode=args.mode,
        script=args.script,
        tokens_per_event=int(tpe) if tpe.isdigit() else tpe,
        delay=args.delay,
    )
    app.router.add_post("/bench/record", record)
    app.router.add_get("/bench/writes", writes)
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    # backlog: 256 streams open 256 producer connections at once (aiohttp listens with 128)
    web.run_app(app, host=args.host, port=args.port, access_log=None, loop=loop, shutdown_timeout=1.0, print=None, backlog=4096)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
