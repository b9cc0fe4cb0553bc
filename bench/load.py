"""The clients: concurrent SSE streams through Envoy, and vLLM's streaming derender client loop."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Stream:
    start: float
    reads: list[float] = field(default_factory=list)  # time of every non-empty body read
    status: int = 0
    body: bytes = b""
    done: bool = False  # ended with data: [DONE]
    end: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.reads[0] - self.start if self.reads else None


HEADERS: dict[str, str] = {}  # more request headers on every stream (e.g. an API key)


def session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=300),
    )


# How a finished stream ends: chat and completions, Anthropic Messages, OpenAI Responses.
ENDINGS = (b"data: [DONE]\n\n", b'{"type":"message_stop"}\n\n', b'"type":"response.completed"}\n\n')


async def stream_one(http: aiohttp.ClientSession, url: str, body: bytes, keep: bool = False) -> Stream:
    result = Stream(start=time.monotonic())
    tail = b""
    parts = []
    async with http.post(url, data=body, headers={"content-type": "application/json", **HEADERS}) as response:
        result.status = response.status
        async for data in response.content.iter_any():
            result.reads.append(time.monotonic())
            tail = (tail + data)[-64:]
            if keep:
                parts.append(data)
    result.end = time.monotonic()
    result.done = tail.endswith(ENDINGS)
    result.body = b"".join(parts)
    return result


async def streams(
    url: str, body: bytes, count: int, concurrency: int, keep_first: bool = True, ramp: float = 0.0
) -> tuple[list[Stream], float]:
    """``count`` streams, at most ``concurrency`` at once, the first ``concurrency`` started
    evenly over ``ramp`` seconds; returns them and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    async with session() as http:

        async def one(i: int) -> Stream:
            if ramp and i < concurrency:
                await asyncio.sleep(ramp * i / concurrency)
            async with gate:
                return await stream_one(http, url, body, keep=keep_first and i == 0)

        start = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(count)))
        return list(results), time.monotonic() - start


async def post_json(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, float]:
    start = time.monotonic()
    async with http.post(url, json=body) as response:
        data = await response.json(content_type=None)
        return response.status, data, time.monotonic() - start


async def derender_loop(vllm_url: str, sim_url: str, chat: dict, generate: dict, model: str) -> dict:
    """vLLM's stateless streaming derender, driven as the RFC's client does it: every
    producer event -> POST /v1/chat/completions/derender with the stream_state echoed back."""
    prompt = generate["token_ids"]
    chunks, latencies = [], []
    state = None
    async with session() as http, http.post(sim_url + "/inference/v1/generate", json=generate) as producer:
        buffer = b""
        async for data in producer.content.iter_any():
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                payload = event[6:] if event.startswith(b"data: ") else None
                if payload is None or payload == b"[DONE]":
                    continue
                request = {
                    "stream": True,
                    "model": model,
                    "generate_chunk": json.loads(payload),
                    "stream_state": state,
                    "prompt_tokens": len(prompt),
                    "prompt_token_ids": prompt,
                    "chat_request": chat,
                }
                status, answer, elapsed = await post_json(http, vllm_url + "/v1/chat/completions/derender", request)
                if status != 200:
                    raise RuntimeError(f"vLLM derender answered {status}: {answer}")
                state = answer["stream_state"]
                chunks.append(answer["chunk"])
                latencies.append(elapsed)
    return {"chunks": chunks, "latencies": latencies, "calls": len(latencies)}
