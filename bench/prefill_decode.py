"""Long prompts arriving while streams decode, with the prefill/decode handoff and without (issue 46).

    .venv/bin/python bench/prefill_decode.py [--seconds 40] [--streams 16] [--every 1.0] [--out bench/PD.md]
    .venv/bin/python bench/prefill_decode.py --layouts= --hop-calls 500     # the prefill call's hop alone

Simulators model one GPU each as vLLM's chunked prefill runs it (``derender sim
--max-num-batched-tokens``): every engine step decodes one token of each running stream and computes the
next chunk of the waiting prompts with the rest of its token budget; a step lasts ``--step-ms`` plus its
prompt tokens times ``--prefill-us-per-token``. A prefill therefore stretches the steps of every stream
decoding on the same replica. A decode that pulls a prefill's KV waits ``--kv-transfer-us-per-token`` per
prompt token, slowing no step (NIXL reads the blocks while the engine runs).

The load, through Envoy and the filter (``derender up``, two workers): ``--streams`` chats decoding
answers of ~300 tokens without pause (each re-sent as it ends), and a chat of a 4k-8k-token prompt
(unique, so no prefix-cache hit) answering 8 tokens every ``--every`` seconds. Three layouts:

- ``handoff``: two decode replicas and one prefill replica (``--replicas 2 --prefill-replicas 1``), every
  prompt of at least 256 tokens (the default ``--pd-min-prompt-tokens``) handed off, the streams' own too;
- ``handoff from 1024 tokens``: the same with ``--pd-min-prompt-tokens 1024``: the streams' ~300-token
  prompts prefill where they decode;
- ``decode alone``: the same two decode replicas without the handoff (``--replicas 2``);
- ``three alike``: three replicas each prefilling and decoding (``--replicas 3``): the same GPU count.

Reported per layout: the running streams' inter-token latency p50 / p99 / max (gaps between their
chunks at the client), the long prompts' time to first token p50 / p99, and per replica the steps that
computed prompt tokens (``/sim/stats``). Then the prefill call alone, made as the filter makes it and
through an Envoy cluster: whether the filter should call prefill replicas itself.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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

LAYOUTS = {
    "handoff": ["--replicas", "2", "--prefill-replicas", "1"],
    "handoff from 1024 tokens": ["--replicas", "2", "--prefill-replicas", "1", "--pd-min-prompt-tokens", "1024"],
    "decode alone": ["--replicas", "2"],
    "three alike": ["--replicas", "3"],
}


def vocabulary(model_dir: str) -> list[str]:
    """Words that are one token each after a space, so a prompt's token count is its word count."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    words = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        word = token[1:]
        if token.startswith("\u0120") and word.isascii() and word.isalpha() and word.islower() and 3 <= len(word) <= 8:
            if len(tokenizer.encode(" " + word, add_special_tokens=False).ids) == 1:
                words.append(word)
        if len(words) >= 3000:
            break
    return words


def text(rng: random.Random, words: list[str], count: int) -> str:
    return " ".join(rng.choice(words) for _ in range(count))


async def chat(http: aiohttp.ClientSession, url: str, content: str, max_tokens: int) -> tuple[float, list[float]]:
    """One streamed chat: its time to the first content chunk and the gaps between its chunks."""
    body = {"model": "qwen3", "messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": max_tokens, "chat_template_kwargs": {"enable_thinking": False}}
    began = time.monotonic()
    stamps = []
    async with http.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.read())[:200]!r}")
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                stamps.append(time.monotonic())
    if not stamps:
        raise RuntimeError("no content")
    return stamps[0] - began, [b - a for a, b in itertools.pairwise(stamps)]


async def drive(url: str, args: argparse.Namespace, words: list[str]) -> dict:
    rng = random.Random(7)
    gaps: list[float] = []
    long_ttft: list[float] = []
    stream_ttft: list[float] = []
    failures: list[str] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        for _ in range(3):  # warm: the filter's first render of each shape
            await chat(http, url, text(rng, words, 50), 4)
        end = time.monotonic() + args.seconds
        measuring = asyncio.Event()

        async def streaming(seed: int) -> None:
            own = random.Random(seed)
            while time.monotonic() < end:
                try:
                    ttft, g = await chat(http, url, text(own, words, 300), 300)
                except (aiohttp.ClientError, RuntimeError) as e:
                    failures.append(repr(e))
                    continue
                if measuring.is_set():
                    gaps.extend(g)
                    stream_ttft.append(ttft)

        async def long_prompt(count: int) -> None:
            try:
                ttft, _ = await chat(http, url, text(random.Random(count), words, count), 8)
                long_ttft.append(ttft)
            except (aiohttp.ClientError, RuntimeError) as e:
                failures.append(repr(e))

        tasks = [asyncio.create_task(streaming(i)) for i in range(args.streams)]
        await asyncio.sleep(3.0)  # every stream running
        measuring.set()
        arrivals = []
        while time.monotonic() < end:
            arrivals.append(asyncio.create_task(long_prompt(rng.randint(4000, 8000))))
            await asyncio.sleep(rng.expovariate(1 / args.every))
        await asyncio.gather(*arrivals)
        await asyncio.gather(*tasks)
    return {"gaps": gaps, "long_ttft": long_ttft, "stream_ttft": stream_ttft, "failures": failures}


def layout(name: str, args: argparse.Namespace, words: list[str]) -> dict:
    port = procs.free_port()
    argv = [procs.PYTHON, "-m", "derender.cli", "up", "--port", str(port), *LAYOUTS[name],
            f"--sim-arg=--delay={args.step_ms / 1000}", f"--sim-arg=--max-num-batched-tokens={args.budget}",
            f"--sim-arg=--prefill-us-per-token={args.prefill_us_per_token}",
            f"--sim-arg=--kv-transfer-us-per-token={args.kv_transfer_us_per_token}"]
    up = procs.Proc("pd-" + name.replace(" ", "-"), argv).start()
    try:
        up.wait(lambda: "endpoint ready" in up.log.read_text(errors="replace"), 300)
        log = up.log.read_text(errors="replace")
        sims = re.findall(r"simulator \(.*\) on (http://\S+)", log)
        began = time.monotonic()
        result = asyncio.run(drive(f"http://127.0.0.1:{port}/v1/chat/completions", args, words))
        result["wall"] = time.monotonic() - began
        result["replicas"] = {u: procs.get_json(u + "/sim/stats") for u in dict.fromkeys(sims)}
    finally:
        up.stop()
    gaps, long_ttft = result["gaps"], result["long_ttft"]
    print(f"[{name}] ITL p50 {procs.pct(gaps, 0.5) * 1e3:.0f} ms p99 {procs.pct(gaps, 0.99) * 1e3:.0f} ms, long-prompt TTFT "
          f"p50 {procs.pct(long_ttft, 0.5) * 1e3:.0f} ms p99 {procs.pct(long_ttft, 0.99) * 1e3:.0f} ms ({len(long_ttft)}), "
          f"failures {len(result['failures'])}", file=sys.stderr, flush=True)
    return result


def report(args: argparse.Namespace, results: dict) -> list[str]:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = (f"`.venv/bin/python bench/prefill_decode.py --seconds {args.seconds} --streams {args.streams} "
               f"--every {args.every}`")
    lines = [
        "# Prefill and decode apart, against together",
        "",
        f"{when}, {command}: simulators with vLLM's chunked prefill modelled (a step of {args.step_ms:g} ms plus "
        f"{args.prefill_us_per_token:g} us per prompt token, {args.budget} tokens a step; a pulled KV waits "
        f"{args.kv_transfer_us_per_token:g} us per token), the filter (two workers) and Envoy (`derender up`). "
        f"{args.streams} chats decode ~300-token answers without pause while a unique 4k-8k-token prompt arrives "
        f"about every {args.every:g} s (8-token answers). Times at the client, ms:",
        "",
        "| layout | streams' inter-token p50 | p99 | max | long prompts' TTFT p50 | p99 | long prompts | "
        "streams' TTFT p50 | steps with prompt chunks, per replica | failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, r in results.items():
        g, t = r["gaps"], r["long_ttft"]
        steps = " / ".join(
            f"{(s.get('kv_handoff') or {}).get('role', '?')}: {(s.get('engine') or {}).get('prefill_steps', 0)}"
            for s in r["replicas"].values()
        )
        lines.append(
            f"| {name} | {procs.pct(g, 0.5) * 1e3:.0f} | {procs.pct(g, 0.99) * 1e3:.0f} | {max(g) * 1e3 if g else float('nan'):.0f} | "
            f"{procs.pct(t, 0.5) * 1e3:.0f} | {procs.pct(t, 0.99) * 1e3:.0f} | {len(t)} | "
            f"{statistics.median(r['stream_ttft']) * 1e3 if r['stream_ttft'] else float('nan'):.0f} | {steps} | "
            f"{len(r['failures'])} |"
        )
    return lines


async def calls(url: str, body: dict, count: int) -> list[float]:
    """``count`` prefill calls one after another on one connection: each one's seconds."""
    took = []
    async with aiohttp.ClientSession() as http:
        for i in range(count + 20):  # 20 to warm
            began = time.monotonic()
            async with http.post(url, json=body) as r:
                answer = await r.json()
            assert answer["kv_transfer_params"]["do_remote_prefill"] is True, answer
            if i >= 20:
                took.append(time.monotonic() - began)
    return took


def hop(args: argparse.Namespace) -> list[str]:
    """The prefill call made by the filter itself against the same call through an Envoy cluster: its
    latency and Envoy's CPU per call (a prefill simulator without pacing: the hop alone)."""
    from derender.ops import assets
    from derender.routing.handoff import ASK

    port = procs.free_port()
    started = []
    try:
        sim = procs.Proc("pd-hop-sim", [procs.PYTHON, "-m", "derender.cli", "sim", "--model", str(assets.fetch("qwen3")),
                                        "--port", str(port), "--kv-role", "prefill"]).start()
        started.append(sim)
        sim.wait(lambda: procs.http_ok(f"http://127.0.0.1:{port}/health"), 120)
        envoy = procs.start_envoy("pd-hop-envoy", port, None)
        started.append(envoy.proc)
        envoy.proc.wait(lambda: procs.http_ok(f"http://127.0.0.1:{envoy.admin}/ready"), 60)
        body = {"model": "qwen3", "token_ids": list(range(1000, 1000 + args.hop_tokens)), "stream": False,
                "sampling_params": {"max_tokens": 1, "temperature": 0.0}, "kv_transfer_params": dict(ASK)}
        rows = []
        for name, base in (("the filter calls the prefill producer", f"http://127.0.0.1:{port}"),
                           ("through an Envoy cluster", envoy.url)):
            envoy_cpu = procs.cpu_of(envoy.proc.tree()[0])
            took = asyncio.run(calls(base + "/inference/v1/generate", body, args.hop_calls))
            spent = (procs.cpu_of(envoy.proc.tree()[0]) - envoy_cpu) / (args.hop_calls + 20)
            rows.append(f"| {name} | {procs.pct(took, 0.5) * 1e3:.2f} | {procs.pct(took, 0.99) * 1e3:.2f} | {spent * 1e6:.0f} |")
    finally:
        for proc in reversed(started):
            proc.stop()
    return [
        "",
        f"The prefill call alone ({args.hop_calls} calls of a {args.hop_tokens}-token prompt one after another, "
        "`max_tokens: 1`, not streamed, a prefill simulator without pacing), made by the filter's way (one "
        "HTTP/1.1 connection kept alive) to the producer and through Envoy (`envoy/local.yaml`'s producer "
        "cluster, no filter):",
        "",
        "| prefill call | latency p50, ms | p99, ms | Envoy CPU per call, us |",
        "|---|---:|---:|---:|",
        *rows,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--every", type=float, default=1.0, help="mean seconds between long prompts")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--prefill-us-per-token", type=float, default=50.0)
    parser.add_argument("--kv-transfer-us-per-token", type=float, default=5.0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--hop-calls", type=int, default=500)
    parser.add_argument("--hop-tokens", type=int, default=4000)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    from derender.ops import assets

    words = vocabulary(str(assets.fetch("qwen3")))
    results = {name: layout(name, args, words) for name in args.layouts.split(",") if name}
    procs.write_report((report(args, results) if results else []) + hop(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
