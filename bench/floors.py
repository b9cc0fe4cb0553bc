"""What the ext_proc round trip per producer event costs: the filter's stack beside its transport
floors, the filter with its response leg in the worker and vLLM's coupled server, in one run.

    .venv/bin/python bench/floors.py [--api chat|messages|responses] [--tokens 250] [--rounds 5] [--out -]

Six sides, all up at once and measured in turn (the order alternating by round), each given
``--streams`` concurrent streams of ``--tokens`` tokens paced one event every ``--delay`` seconds:

- ``alone``: Envoy proxying the producer's stream (the client posts the producer request itself);
- ``relay``: Envoy -> ``bench/byte_relay.py`` -> the producer: a process in the response path that
  reads each event and writes it on, as a filter that were Envoy's upstream would (Envoy + relay);
- ``echo``: Envoy + ``bench/echo_extproc.py`` (Envoy asks it about every event and it answers with the
  same bytes): the ext_proc transport floor (Envoy + echo);
- ``filter``: Envoy + ``derender serve`` with the default flags, through ``--api`` (Envoy + filter);
- ``leg``: Envoy + ``derender serve --response-leg worker`` with the default flags otherwise, through
  ``--api``: ext_proc renders, then Envoy sends the request to the worker, which reaches the producer and
  translates each event in the response path (``derender.extproc.leg``), with no ext_proc message per
  event, on HTTP/2 from Envoy to the worker (Envoy + filter; on HTTP/1.1 until 8a8e436, and until
  2026-12-07 evening ``bench/upstream_proto.py``, a prototype of it, in git history);
- ``coupled``: vLLM's coupled server (``bench/coupled_vllm.py``) through ``--api``.

The floors' producer request is a fixed prompt of token ids (the simulator's script sets the answer,
as for the three sides asked through ``--api``). Per round, each side's CPU per token (microseconds) and its ratio to the
coupled server's in that round, and the streams' median time to their first body read (comparable among
the five sides the simulator paces; the coupled server's engine paces its first output otherwise);
the report has every round and the medians. The last row estimates a
filter in the upstream position from the others, as the ``leg`` side measures it: the relay floor
plus what the filter's worker costs over the echo server's (the same translation, without Envoy's
ext_proc hop or the gRPC framing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import procs
import streams
from stream_interval import HERMES

SIDES = ("alone", "relay", "echo", "filter", "leg", "coupled")


def cpu_per_token(url: str, body: bytes, group: list[procs.Proc], count: int, tokens: int) -> tuple[list[float], float]:
    """``count`` concurrent streams at ``url``; each of ``group``'s CPU microseconds per token, and the
    streams' median time to their first body read in milliseconds."""
    cpus, firsts = procs.streams_run(url, body, group, count)
    return [cpu / (count * tokens) * 1e6 for cpu in cpus], statistics.median(firsts) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    procs.paced_options(parser, tokens=250, rounds=5, api_help="the filter's and the coupled server's API")
    args = parser.parse_args()
    path, api_body = streams.API_PATHS[args.api], streams.api_body(args.api)
    procs.exit_on_sigterm()
    model_dir, script = procs.reasoning_script("floors", args.tokens)
    prompt = streams._ids(model_dir, streams.prompt_of(model_dir, 200))
    generate = json.dumps({"token_ids": prompt, "sampling_params": {"max_tokens": 4096, "temperature": 0, "n": 1},
                           "stream": True}).encode()
    started: list[procs.Proc] = []
    rows: list[dict[str, list[float]]] = []
    firsts: dict[str, list[float]] = {side: [] for side in SIDES}  # each round's median first read, ms
    try:
        serve = ["--served-model-name", "qwen3", "--max-model-len", "40960", *HERMES]
        server, envoy = procs.start_stack(started, "floors", model_dir, script, serve, args.delay)
        sim_port = int(started[0].argv[started[0].argv.index("--port") + 1])  # start_stack's simulator
        relay_port, echo_port, leg_port = procs.free_port(), procs.free_port(), procs.free_port()
        relay = procs.Proc("floors-relay", [procs.PYTHON, str(BENCH / "byte_relay.py"), "--port", str(relay_port),
                                            "--target-port", str(sim_port)]).start()
        started.append(relay)
        echo_socket = procs.unix_path("floors-echo")
        echo = procs.Proc("floors-echo", [procs.PYTHON, str(BENCH / "echo_extproc.py"), "--port", str(echo_port),
                                          "--workers", "1", "--uds", echo_socket]).start()
        started.append(echo)
        leg_socket = procs.unix_path("floors-leg")
        leg = procs.Proc("floors-leg", [procs.PYTHON, "-m", "derender.cli", "serve", "--model", model_dir, *serve,
                                        "--producer", f"http://127.0.0.1:{sim_port}", "--response-leg", "worker",
                                        "--port", str(leg_port), "--uds", leg_socket]).start()
        started.append(leg)
        relay.wait(lambda: procs.tcp_open(relay_port), 60)
        echo.wait(lambda: procs.tcp_open(echo_port), 120)
        leg.wait(lambda: procs.tcp_open(leg_port), 600)
        envoys = {"alone": procs.start_envoy("floors-envoy-alone", sim_port, None),
                  "relay": procs.start_envoy("floors-envoy-relay", relay_port, None),
                  "echo": procs.start_envoy("floors-envoy-echo", sim_port, echo_port, unix=echo_socket),
                  "leg": procs.start_envoy("floors-envoy-leg", sim_port, leg_port, unix=leg_socket, leg=True)}
        for e in envoys.values():
            started.append(e.proc)
            e.proc.wait(lambda e=e: procs.http_ok(f"http://127.0.0.1:{e.admin}/ready"), 60)
        coupled, base = procs.start_coupled(started, "floors-coupled", model_dir, script, HERMES, args.delay)
        generate_path = "/inference/v1/generate"
        sides = {
            "alone": (envoys["alone"].url + generate_path, generate, [envoys["alone"].proc]),
            "relay": (envoys["relay"].url + generate_path, generate, [envoys["relay"].proc, relay]),
            "echo": (envoys["echo"].url + generate_path, generate, [envoys["echo"].proc, echo]),
            "filter": (envoy.url + path, api_body, [envoy.proc, server]),
            "leg": (envoys["leg"].url + path, api_body, [envoys["leg"].proc, leg]),
            "coupled": (base + path, api_body, [coupled]),
        }
        for url, body, group in sides.values():  # warm-up
            cpu_per_token(url, body, group, args.streams, args.tokens)
        for round_ in range(args.rounds):
            row: dict[str, list[float]] = {}
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                url, body, group = sides[side]
                row[side], first = cpu_per_token(url, body, group, args.streams, args.tokens)
                firsts[side].append(first)
            rows.append(row)
            print(f"round {round_ + 1}: " + ", ".join(f"{s} {'+'.join(f'{x:.1f}' for x in row[s])}" for s in SIDES), flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()

    def total(row: dict[str, list[float]], side: str) -> float:
        return sum(row[side])

    def upstream(row: dict[str, list[float]]) -> float:
        return total(row, "relay") + row["filter"][1] - row["echo"][1]

    def part(side: str, i: int) -> float:
        return statistics.median(row[side][i] for row in rows)

    def ratio(f) -> str:
        return f"{statistics.median(f(row) / total(row, 'coupled') for row in rows):.2f}x"

    labels = {
        "alone": "Envoy alone",
        "relay": "Envoy + byte relay (the upstream position's floor)",
        "echo": "Envoy + echo ext_proc (the ext_proc floor)",
        "filter": f"Envoy + derender ({args.api})",
        "leg": f"Envoy + derender, the response leg in the worker ({args.api})",
        "coupled": f"vLLM's coupled server ({args.api})",
    }
    lines = [
        "# The ext_proc round trip against a byte relay, and the response leg in the worker",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `.venv/bin/python bench/floors.py --api "
        f"{args.api} --streams {args.streams} --tokens {args.tokens} --delay {args.delay} --rounds {args.rounds}`: "
        f"{args.streams} concurrent streams of {args.tokens} tokens, one token per event every {args.delay * 1e3:.0f} ms, "
        "on six sides up at once and measured in turn, the order alternating by round. CPU microseconds per token, "
        "medians of the rounds; the ratio pairs each round's side with that round's coupled server. First read: "
        "a stream's first body bytes after its request was sent (the floors' sides: the producer's first event), "
        "the median of each round's median; the coupled server's bench engine paces its first output otherwise than the "
        "simulator does, so compare first reads among the other sides.",
        "",
        "| side | Envoy | the other process | together | against the coupled server | first read, ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for side in SIDES:
        envoy_part = f"{part(side, 0):.1f}" if side != "coupled" else ""
        other = f"{part(side, 1):.1f}" if len(rows[0][side]) > 1 else ("" if side == "alone" else f"{part(side, 0):.1f}")
        lines.append(f"| {labels[side]} | {envoy_part} | {other} | {statistics.median(total(r, side) for r in rows):.1f} | "
                     f"{ratio(lambda r, s=side: total(r, s))} | {statistics.median(firsts[side]):.1f} |")
    lines += [
        f"| estimate: the filter as Envoy's upstream (relay + filter worker - echo worker) | | | "
        f"{statistics.median(upstream(r) for r in rows):.1f} | {ratio(upstream)} | |",
        "",
        "Every round (us per token: Envoy + the other process):",
        "",
        *(f"- round {i}: " + ", ".join(f"{s} {'+'.join(f'{x:.1f}' for x in row[s])}" for s in SIDES)
          for i, row in enumerate(rows, 1)),
    ]
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
