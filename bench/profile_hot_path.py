"""The filter's per-token work without gRPC: CPU per token by stream length, and a profile.

Feeds the simulator's exact SSE bytes (one token per event) into the production
``ChatExchange.response_chunk`` -- what the ext_proc servicer calls for every Envoy
body chunk -- after a real ``request_body`` render, in this process, and reports
CPU microseconds per token for each length. ``--profile`` adds cProfile's top
functions for the longest stream.

    python bench/profile_hot_path.py --lengths 250,1000,2000 --profile [--stream-path vllm] [--api messages|responses]

Also reported: the request's fixed CPU (``request_body``'s render, every thread of this process)
and, from two lengths, the cost per token and per stream that the lengths' totals imply.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pydantic_core
import streams
from derender.ops import assets
from derender.sim import Simulator, _Choice

HERMES = ("qwen3", "hermes")


def events(token_ids: list[int]) -> list[bytes]:
    """The simulator's frames for one choice, one token per event, then [DONE]."""
    choice = _Choice(0, token_ids, "stop", None, [1] * len(token_ids), None)
    frames = []
    for i in range(len(token_ids)):
        final = i == len(token_ids) - 1
        chunk = {"request_id": "generate-tokens-bench", "usage": None, "output_mode": "tokens"}
        chunk["choices"] = [Simulator._choice(choice, i, i + 1, final, None)]
        frames.append(b"data: " + pydantic_core.to_json(chunk) + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


async def one_stream(model, producer, chat: bytes, frames: list[bytes], api: str = "chat") -> tuple[float, bytes, float]:
    """(CPU of the response's chunks, the client's bytes, CPU of ``request_body``: the render)."""
    if api == "responses":
        from derender.endpoints.responses import ResponsesExchange as Exchange
    elif api == "messages":
        from derender.endpoints.messages import MessagesExchange as Exchange
    else:
        from derender.endpoints.chat import ChatExchange as Exchange

    exchange = Exchange(model, producer, None)
    start = time.process_time()
    await exchange.request_body(chat)
    render = time.process_time() - start
    exchange.response_headers(200)
    out = []
    start = time.process_time()
    for frame in frames:
        out.append(await exchange.response_chunk(frame, False))
    out.append(await exchange.response_chunk(b"", True))
    elapsed = time.process_time() - start
    exchange.close(True)
    return elapsed, b"".join(out), render


def hermes_model(model_dir: str):
    """Qwen3 with the qwen3 reasoning parser and the hermes tool parser, as the bench serves it."""
    from derender.translate.model import Model, ModelSpec

    spec = ModelSpec(
        model=model_dir,
        served_model_name=("qwen3",),
        max_model_len=40960,
        reasoning_parser=HERMES[0],
        tool_call_parser=HERMES[1],
        enable_auto_tool_choice=True,
    )
    return Model(spec)


async def measure(model, model_dir: str, lengths: list[int], repeat: int, profile: bool, api: str = "chat") -> dict:
    from derender.routing.producer import Producer

    producer = Producer("http://127.0.0.1:9")
    request = streams.chat_request("qwen3", tools=True)
    chat = json.dumps(request if api == "chat" else streams.agent_request(request, api)).encode()
    result: dict = {"us_per_token": {}, "fold": {}, "render_us": {}}
    for _ in range(3):  # warm up
        await one_stream(model, producer, chat, events(streams.reasoning_tool_call(model_dir, 64)), api)
    for n in lengths:
        frames = events(streams.reasoning_tool_call(model_dir, n))
        best = render = None
        for _ in range(repeat):
            elapsed, body, rendered = await one_stream(model, producer, chat, frames, api)
            best = elapsed if best is None else min(best, elapsed)
            render = rendered if render is None else min(render, rendered)
        result["us_per_token"][n] = best / n * 1e6
        result["render_us"][n] = render * 1e6
        if api == "chat":
            result["fold"][n] = streams.digest(streams.fold(streams.sse_events(body)))
    if profile:
        frames = events(streams.reasoning_tool_call(model_dir, max(lengths)))
        profiler = cProfile.Profile()
        profiler.enable()
        await one_stream(model, producer, chat, frames, api)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(int(os.environ.get("PROFILE_ROWS", "25")))
        result["profile"] = text.getvalue()
    await producer.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Qwen3 tokenizer folder (default: the fetched one)")
    parser.add_argument("--lengths", default="250,1000,2000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--stream-path", choices=("lean", "vllm"), default="lean",
                        help="as derender serve --stream-path (default lean)")
    parser.add_argument("--when-told", action="store_true", help="load, print 'loaded', measure after a line on stdin")
    parser.add_argument("--api", choices=("chat", "messages", "responses"), default="chat", help="which exchange (default chat)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model_dir = args.model or str(assets.fetch("qwen3", quiet=True))
    lengths = [int(x) for x in args.lengths.split(",")]
    model = hermes_model(model_dir)
    try:
        from derender.settings import Settings

        model = model.with_settings(Settings(stream_path=args.stream_path))
    except ImportError:  # a tree from before the settings object (an A/B against it): its module switch
        try:
            from derender.translate import lean

            lean.ENABLED = args.stream_path == "lean"
        except ImportError:  # from before the lean path
            pass
    if args.when_told:
        print("loaded", flush=True)
        sys.stdin.readline()
    result = asyncio.run(measure(model, model_dir, lengths, args.repeat, args.profile, args.api))
    if args.json:
        print(json.dumps(result))
        return 0
    for n, us in result["us_per_token"].items():
        print(f"{n:>6} tokens: {us:8.1f} us CPU per token (translation only, no gRPC); "
              f"render {result['render_us'][n]:.0f} us CPU per request")
    if len(lengths) >= 2:  # the chunks' CPU as a + b * n over the shortest and longest stream
        short, long = min(lengths), max(lengths)
        total = {n: result["us_per_token"][n] * n for n in (short, long)}
        per_token = (total[long] - total[short]) / (long - short)
        print(f"from {short} and {long} tokens: {per_token:.1f} us per token, {total[short] - per_token * short:.0f} us "
              "per stream (its first and last events) besides the render")
    if "profile" in result:
        print(result["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
