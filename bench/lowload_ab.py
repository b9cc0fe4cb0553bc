"""Two source trees of the filter side by side at low load: latency per token, and time to first token for long prompts.

    .venv/bin/python bench/lowload_ab.py --before /path/to/old/checkout
    .venv/bin/python bench/lowload_ab.py --before ../old --before-socket tcp --before-envoy-concurrency 2 \\
        --out bench/LOWLOAD_AB.md      # a tree from before --uds, with its defaults

Both trees' stacks (a simulator with a clock on its writes, ``bench/timed_sim.py``; a filter; Envoy
1.40, ``bench/procs.py``'s config) run side by side for the whole measurement, one stream at a
time; the filters run with their own default flags but for what ``--before-flags`` and
``--after-flags`` add. The after tree runs on its response leg with the leg's Envoy config, as
``derender up`` runs it, and the before tree through ext_proc for every event (what a tree from before
the leg has), unless ``--before-leg`` / ``--after-leg`` say otherwise (``--before . --before-leg no``:
this tree through ext_proc beside its leg).

Latency per token: in rounds that alternate which tree goes first, each tree serves one reasoning +
tool-call stream of ``--latency-tokens`` tokens, one event every 10 ms; a token's latency is from the
simulator's write of its event to the client's read of what it became (as ``bench/run.py``'s
section 1).

Time to first token: the simulator answers at once with 4 tokens. For each prompt length, in
rounds that alternate which tree goes first, each tree is sent:
- a **cold** request: a chat request (the bench's system prompt and tool) whose user message of about
  that many tokens starts with a word never sent before, so that no part of the user's turn was seen
  (a new conversation of an agent whose system prompt the filter knows);
- a **warm** request: the same long message every time (a turn the filter has seen: what an agent's
  next turn re-sends).
Time to first token is from the request's start to the client's first read, through Envoy. The
median of the rounds, and each tree's rounds, are reported; the first ``--warmup`` rounds are not
timed (each process meets the prompt's length and the warm prompt first).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import json
import os
import shlex
import statistics
import sys
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load
import procs
import streams
from paced_ab import commit_of
from stream_interval import HERMES


def latency(sim_url: str, url: str, chat: dict) -> list[float]:
    """One paced stream's latency per token, in seconds: each read from the simulator's write before it."""
    procs.post(sim_url + "/bench/record", {"on": True})
    results, _ = asyncio.run(load.streams(url, json.dumps(chat).encode(), 1, 1))
    procs.post(sim_url + "/bench/record", {"on": False})
    writes = sorted(procs.get_json(sim_url + "/bench/writes"))  # type: ignore[arg-type]
    [result] = results
    assert result.done, "a stream failed"
    return [read - writes[i] for read in result.reads if (i := bisect.bisect_right(writes, read) - 1) >= 0]


def ask(url: str, chat: dict) -> float:
    """One chat stream's time to first token, in seconds."""
    results, _ = asyncio.run(load.streams(url, json.dumps(chat).encode(), 1, 1))
    [result] = results
    assert result.done and result.ttft is not None, "a stream failed"
    return result.ttft


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of the filter to compare this tree with")
    parser.add_argument("--after", default=None, help="the other checkout (default: this tree)")
    parser.add_argument("--prompts", default="1000,8000,32000", help="user messages' sizes in tokens (default 1000,8000,32000)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds of each prompt length (default 9)")
    parser.add_argument("--latency-rounds", type=int, default=6, help="paced streams per tree (default 6)")
    parser.add_argument("--latency-tokens", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--before-flags", default="", help="more `derender serve` flags for the before tree")
    parser.add_argument("--after-flags", default="", help="more `derender serve` flags for the after tree")
    parser.add_argument("--before-envoy-concurrency", type=int, default=None)
    parser.add_argument("--after-envoy-concurrency", type=int, default=None)
    parser.add_argument("--before-socket", choices=["unix", "tcp"], default="unix",
                        help="how Envoy reaches the before tree's filter (tcp: a tree from before --uds)")
    parser.add_argument("--before-leg", choices=["yes", "no"], default="no",
                        help="the before tree's filter on its response leg, Envoy with the leg's config (default no: "
                        "ext_proc for every event, what a tree from before the leg has)")
    parser.add_argument("--after-leg", choices=["yes", "no"], default="yes",
                        help="the same for the after tree (default yes: as `derender up` runs it)")
    parser.add_argument("--out", default="-", help="the report (default '-': stdout only)")
    args = parser.parse_args()
    procs.exit_on_sigterm()
    model_dir, script = procs.reasoning_script("lowload-ab", args.latency_tokens)  # the simulators read it per request
    trees = {"before": args.before, "after": args.after}
    started: list[procs.Proc] = []
    urls: dict[str, str] = {}
    sims: dict[str, str] = {}
    try:
        for name, tree in trees.items():
            env = dict(os.environ)
            if tree is not None:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(tree) / "filter"), env.get("PYTHONPATH")]))
            flags = shlex.split(getattr(args, f"{name}_flags"))
            serve = ["--served-model-name", "qwen3", "--max-model-len", "40960", *HERMES, *flags]
            _, envoy = procs.start_stack(started, f"lowload-{name}", model_dir, script, serve, 0.01, env=env,
                                         sim=[procs.PYTHON, str(BENCH / "timed_sim.py")],
                                         envoy_concurrency=getattr(args, f"{name}_envoy_concurrency"),
                                         unix=name == "after" or args.before_socket == "unix",
                                         leg=getattr(args, f"{name}_leg") == "yes")
            urls[name] = envoy.url + "/v1/chat/completions"
            producer = started[-3]  # start_stack starts the simulator, the filter, Envoy
            sims[name] = f"http://127.0.0.1:{producer.argv[producer.argv.index('--port') + 1]}"
        delays: dict[str, list[float]] = {name: [] for name in trees}
        chat = streams.chat_request("qwen3", tools=True)
        for name in trees:
            latency(sims[name], urls[name], chat)  # untimed: each stack's first stream
        for i in range(args.latency_rounds):
            for name in list(trees) if i % 2 == 0 else list(reversed(trees)):
                delays[name] += latency(sims[name], urls[name], chat)
        print("latency per token p50: " + ", ".join(f"{name} {procs.pct(v, 0.5) * 1e3:.2f} ms" for name, v in delays.items()),
              flush=True)
        full = streams.reasoning_tool_call(model_dir, 64)
        script.write_text(streams.script_line(full[:3] + full[-1:]))  # reasoning opens, two tokens, end of turn
        for name in trees:
            procs.post(sims[name] + "/sim/config", {"delay": 0.0})
        sizes = [int(n) for n in args.prompts.split(",")]
        times: dict[int, dict[str, dict[str, list[float]]]] = {}
        for n in sizes:
            text = streams.prompt_of(model_dir, n)
            warm = streams.chat_request("qwen3", tools=True, prompt=text, max_tokens=128)
            times[n] = {name: {"cold": [], "warm": []} for name in trees}
            for i in range(args.warmup + args.rounds):
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                for name in order:
                    cold = streams.chat_request("qwen3", tools=True, prompt=f"{uuid.uuid4().hex} {text}", max_tokens=128)
                    got = {"cold": ask(urls[name], cold), "warm": ask(urls[name], warm)}
                    if i >= args.warmup:
                        for kind, seconds in got.items():
                            times[n][name][kind].append(seconds)
            print(f"{n} tokens: " + ", ".join(f"{name} {kind} {statistics.median(v) * 1e3:.1f} ms"
                                               for name, kinds in times[n].items() for kind, v in kinds.items()),
                  flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()
    command = (f"`.venv/bin/python bench/lowload_ab.py --before <checkout of {commit_of(args.before)}>"
               f"{' --after <checkout>' if args.after else ''} --rounds {args.rounds}"
               + "".join(f" --{flag.replace('_', '-')} {shlex.quote(str(value))}" for flag, value in vars(args).items()
                         if flag.startswith(("before_", "after_")) and value and value != "unix") + "`")
    lines = [
        "# Two trees of the filter at low load",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {command}: one request at a time "
        "through Envoy, the two stacks side by side. Time to first token: "
        f"{args.rounds} rounds after {args.warmup} untimed ones; the answer is 4 tokens sent at once. Cold: the "
        "user's message starts with a word never sent before; warm: the same message every time. Median ms (every "
        "round below).",
        "",
        "Latency per token at low load (one stream at a time, one event every 10 ms; "
        f"{args.latency_rounds} streams of {args.latency_tokens} tokens per tree), ms:",
        "",
        "| tree | p50 | p90 | p99 | tokens |",
        "|---|---:|---:|---:|---:|",
        *(f"| {name} ({commit_of(trees[name])}) | {procs.pct(v, 0.5) * 1e3:.2f} | {procs.pct(v, 0.9) * 1e3:.2f} | "
          f"{procs.pct(v, 0.99) * 1e3:.2f} | {len(v)} |" for name, v in delays.items()),
        "",
        "Time to first token:",
        "",
        "| user message, tokens | before, cold | after, cold | after / before, cold | before, warm | after, warm | "
        "after / before, warm |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, by_tree in times.items():
        cells = []
        for kind in ("cold", "warm"):
            b, a = (statistics.median(by_tree[name][kind]) for name in ("before", "after"))
            cells += [f"{b * 1e3:.1f}", f"{a * 1e3:.1f}", f"{a / b:.2f}x"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Every round, ms:", ""]
    for n, by_tree in times.items():
        for name, kinds in by_tree.items():
            for kind, values in kinds.items():
                lines.append(f"- {n} tokens, {name} ({commit_of(trees[name])}), {kind}: "
                             + " / ".join(f"{v * 1e3:.1f}" for v in values))
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
