"""The lean path's delta-model validators (``parser_tables``: ``DeltaMessage`` and ``DeltaToolCall``
without vLLM's extra-field logger) against vLLM's, toggled in one process.

Runs ``profile_hot_path``'s streams (the production exchange fed the simulator's bytes, one token an
event) for chat, Messages and Responses, alternating the two validators stream by stream, and prints
the median translation CPU per token of each. One process, interleaved: the machine's drift between
runs is larger than the effect.

    .venv/bin/python bench/delta_models_ab.py [--tokens 400] [--streams 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_hot_path
import streams
from derender.ops import assets
from derender.translate import parser_tables


def use(swaps: list, ours: bool) -> None:
    for cls, theirs, lean in swaps:
        cls.__pydantic_validator__ = lean if ours else theirs


async def measure(model, model_dir: str, tokens: int, count: int) -> list[str]:
    from derender.routing.producer import Producer

    swaps = parser_tables._model_swaps()
    if not swaps:
        return ["the seam moved: the lean path keeps vLLM's validators, nothing to compare"]
    producer = Producer("http://127.0.0.1:9")
    request = streams.chat_request("qwen3", tools=True)
    frames = profile_hot_path.events(streams.reasoning_tool_call(model_dir, tokens))
    lines = []
    try:
        for api in ("chat", "messages", "responses"):
            body = json.dumps(request if api == "chat" else streams.agent_request(request, api)).encode()
            for _ in range(3):  # warm up
                await profile_hot_path.one_stream(model, producer, body, frames, api)
            took: dict[bool, list[float]] = {True: [], False: []}
            for i in range(2 * count):
                ours = i % 2 == 0
                use(swaps, ours)
                elapsed, _, _ = await profile_hot_path.one_stream(model, producer, body, frames, api)
                took[ours].append(elapsed / tokens * 1e6)
            use(swaps, True)
            lean, vllms = statistics.median(took[True]), statistics.median(took[False])
            lines.append(f"{api}: {lean:.2f} us a token without the logger, {vllms:.2f} with it: {lean / vllms:.3f}x")
    finally:
        use(swaps, True)
        await producer.close()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--streams", type=int, default=15, help="streams each way, per API")
    args = parser.parse_args()
    model_dir = str(assets.fetch("qwen3", quiet=True))
    model = profile_hot_path.hermes_model(model_dir)  # a lean model: the patches are installed
    for line in asyncio.run(measure(model, model_dir, args.tokens, args.streams)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
