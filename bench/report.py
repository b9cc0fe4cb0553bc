"""A benchmark run's results as Markdown: tables, then the issue's targets as measured ratios."""

from __future__ import annotations

import math
import statistics

NAMES = {
    "envoy": "Envoy alone (no ext_proc)",
    "echo": "Envoy + echo ext_proc (floor)",
    "echo-fds": "Envoy + echo ext_proc, FDS",
    "echo-grpcio": "Envoy + echo ext_proc on grpc.aio (--transport grpcio)",
    "plain": "Envoy + derender, Qwen3",
    "hermes": "Envoy + derender, qwen3 + hermes",
    "hermes-vllm": "Envoy + derender, qwen3 + hermes, --stream-path vllm",
    "hermes-fds": "Envoy + derender, qwen3 + hermes, FDS",
    "hermes-grpcio": "Envoy + derender, qwen3 + hermes, --transport grpcio",
    "vllm-coupled": "vLLM coupled API server, qwen3 + hermes (asked directly)",
    "vllm-coupled-messages": "vLLM coupled API server, qwen3 + hermes, /v1/messages (asked directly)",
    "vllm-coupled-responses": "vLLM coupled API server, qwen3 + hermes, /v1/responses (asked directly)",
    "hermes-messages": "Envoy + derender, qwen3 + hermes, /v1/messages",
    "hermes-responses": "Envoy + derender, qwen3 + hermes, /v1/responses",
}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def check(ok: bool) -> str:
    return "met" if ok else "**not met**"


def markdown(r: dict) -> str:
    env, plan = r["env"], r["plan"]
    out = [
        "# derender benchmark",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}` (wall time {env.get('wall_minutes', 0):.1f} min)",
        (f"- machine: {env['cpus']} CPUs ({env['cpu']}), shared by the client, the simulator, Envoy "
        f"({env.get('envoy_concurrency', 2)} threads) and "
        f"the servers; load average at start {', '.join(f'{x:.2f}' for x in env['load'])}"),
        f"- versions: Python {env['python']}, " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
        (f"- ext_proc servers run `--workers {env['workers']}` (the echo servers one where the filter runs auto; forked, "
        "SO_REUSEPORT, uvloop); the bench "
        f"sets the ext_proc cluster's `max_concurrent_streams` to {env.get('streams_per_connection')} "
        f"(`envoy/local.yaml`: {env.get('local_streams_per_connection')}): Envoy opens a connection when its "
        "open ones are full, and the kernel spreads connections over the workers"),
        ("- every stream: Qwen3 reasoning + one hermes tool call + EOS from `derender sim` (script mode), one token "
        "per event, through Envoy 1.40 with `envoy/local.yaml`"),
        ("- the filters on our HTTP/2 transport run their default `--response-leg auto` and their Envoy has the leg's "
        "config, as `derender up` writes it: each worker reaches the producer itself and Envoy sends it no ext_proc "
        "message per event (`msgs to ext_proc /token` near 0); the grpc.aio filter's Envoy has no leg (ext_proc for "
        "every event)"),
        ("- vLLM's derender streams (section 2) take minutes of one core: they run on their own simulator and "
         "`vllm launch render` beside our length runs of section 2 only (CPU is counted per process there); latency, "
         "throughput and time to first token have the machine to themselves"),
        "- load average when each phase started: "
        + ", ".join(f"{k} {v:.1f}" for k, v in r.get("load_average", {}).items()),
        "",
    ]
    latency, load = r.get("latency", {}), r.get("throughput", {})
    floor = latency.get("envoy", {}).get("latency", {})
    out += [
        (f"## 1. Transport floor vs the filter, low load ({plan['latency_streams']} streams one after another, "
        f"{plan['latency_tokens']} tokens, one event every {plan['latency_delay'] * 1e3:.0f} ms)"),
        "",
        "Latency per token: from the simulator's write of an event to the client's read of what it became.",
        "",
    ]
    rows = []
    for name, run in latency.items():
        lat = run["latency"]
        rows.append([
            NAMES.get(name, name),
            num(run["cpu_us_per_token"].get("server")),
            num(run["cpu_us_per_token"].get("envoy")),
            ms(lat["p50"]),
            ms(lat["p99"]),
            ms(lat["p50"] - floor.get("p50", math.nan)) if name != "envoy" else "",
            ms(lat["p99"] - floor.get("p99", math.nan)) if name != "envoy" else "",
        ])
    out += table(
        ["path", "ext_proc CPU us/token", "Envoy CPU us/token", "p50 ms/token", "p99 ms/token", "added p50 ms", "added p99 ms"], rows
    )
    out += paced_sections(plan, load)
    lengths, vllm, hot = r.get("lengths", {}), r.get("vllm_derender", {}), r.get("hot_path", {})
    out += [
        "## 2. The filter vs vLLM's streaming derender, qwen3 + hermes, reasoning + tool-call streams",
        "",
        ("Server CPU per token over the whole stream. Ours: the filter's processes (gRPC included), "
        f"{plan['length_streams']} streams at once through Envoy; translation only: the same code fed in process "
        "without gRPC (`bench/profile_hot_path.py`). vLLM: `vllm launch render`, one `POST "
        "/v1/chat/completions/derender` per event with `stream_state` echoed back (the RFC's client loop). "
        "vLLM coupled: the API server `vllm serve` builds (`bench/coupled_vllm.py`: its FastAPI app, "
        "`OpenAIServingChat`, output processor and parsers; the engine replaced by the same token streams, one "
        "token per engine step), the same streams asked of it directly, CPU of that process only (it also does "
        "the HTTP work Envoy does for ours, and not the engine-core IPC a real one does). Same output: the "
        "folded content, reasoning and tool calls of the first stream of each."),
        "",
    ]
    rows = []
    for n in sorted(set(map(int, lengths)) | set(map(int, vllm))):
        ours = lengths.get(n, lengths.get(str(n), {}))
        theirs = vllm.get(n, vllm.get(str(n), {}))
        ours_cpu = ours.get("cpu_us_per_token", {}).get("server")
        theirs_cpu = theirs.get("cpu_us_per_token")
        same = "-"
        if ours.get("fold") and theirs.get("fold"):
            same = "yes" if ours["fold"] == theirs["fold"] else "**no**"
        translation = hot.get("us_per_token", {}).get(str(n)) or hot.get("us_per_token", {}).get(n)
        coupled = ours.get("coupled", {}).get("cpu_us_per_token", {}).get("server")
        if ours.get("fold") and ours.get("coupled", {}).get("fold"):
            same += "" if ours["fold"] == ours["coupled"]["fold"] else " (**coupled differs**)"
        rows.append([
            str(n),
            num(ours_cpu),
            num(translation),
            num(coupled),
            f"{coupled / ours_cpu:.2f}x" if coupled and ours_cpu else "-",
            num(theirs_cpu / 1e3 if theirs_cpu else None, 1),
            f"{theirs_cpu / ours_cpu:,.0f}x" if ours_cpu and theirs_cpu else "-",
            ms(theirs.get("call_p50_last10")),
            same,
        ])
    out += table(
        ["tokens", "ours us/token", "ours, translation only us/token", "vLLM coupled us/token", "coupled / ours",
         "vLLM derender ms/token", "vLLM / ours",
         "vLLM p50 call, last 10 % (ms)", "same output"],
        rows,
    )
    out += [""] + agent_rows(r)

    ttft = r.get("ttft", {})
    out += [
        "## 3. Time to first token, long prompts (qwen3 + hermes request with one tool)",
        "",
        ("Ours: through Envoy + filter (render, producer, first chunk). Envoy alone: the same producer request, "
        "rendered beforehand, straight through Envoy. vLLM /render: the same chat request to `vllm launch render`. "
        "Rendering: the filter's own `render_ms` (request log: body in, producer request out), median of the same "
        "requests; the rest of what it adds is four ext_proc messages through Envoy and the first chunk's translation. "
        "One request at a time, interleaved (ours, Envoy alone, /render), measured after vLLM's derender streams "
        f"of section 2 are done: {plan.get('ttft_warmup', 0)} untimed rounds per prompt (each server process meets "
        f"the prompt first), then the median of {plan['ttft_repeat']}; the answer is 4 tokens, sent at once."),
        "",
    ]
    rows = []
    for n, t in ttft.items():
        added = t["ours"] - t["envoy"]
        render = t.get("ours_render")
        rows.append([str(t["prompt_tokens"]), ms(t["ours"]), ms(t["envoy"]), ms(added), ms(render), ms(t["vllm_render"]),
                     f"{added / t['vllm_render']:.2f}", f"{render / t['vllm_render']:.2f}" if render else "-"])
    out += table(["prompt tokens", "TTFT ours ms", "TTFT Envoy alone ms", "added by the filter ms",
                  "of which rendering ms", "vLLM /render ms", "added / vLLM render", "rendering / vLLM render"], rows)

    memory = r.get("memory", {})
    out += ["## 4. Memory per worker (after the run)", ""]
    rows = []
    for name, workers in memory.items():
        for w in workers:
            rows.append([NAMES.get(name, "vLLM launch render" if name == "vllm" else name), str(w["pid"]),
                         num(w["rss"]), num(w["uss"])])
    out += table(["server", "pid", "RSS MiB", "USS MiB (not shared)"], rows)

    out += ["## Targets (ratios from this run)", ""]
    out += targets(r)
    out += fds_note(r)
    if hot.get("profile"):
        out += ["## Hot path profile (cProfile, longest stream, translation only)", "", "```", hot["profile"].strip()[:6000], "```", ""]
    return "\n".join(out)


def agent_rows(r: dict) -> list[str]:
    """The chat / Messages / Responses CPU-per-token table (``agent_lengths``)."""
    agents = r.get("agent_lengths") or {}
    if not agents:
        return []
    rows = []
    for n in sorted(agents, key=int):
        cpu = {e: run.get("cpu_us_per_token", {}).get("server") for e, run in agents[n].items()}
        chat = cpu.get("chat")
        rows.append([str(n), num(chat), num(cpu.get("messages")), num(cpu.get("responses")),
                     num(cpu["messages"] / chat, 2) if chat and cpu.get("messages") else "-",
                     num(cpu["responses"] / chat, 2) if chat and cpu.get("responses") else "-"])
    plan = r.get("plan", {})
    return [
        "## The agent APIs beside chat, qwen3 + hermes, reasoning + tool-call streams",
        "",
        (f"The filter's CPU per token (its processes, gRPC included; {plan.get('length_streams')} streams at once "
         "through Envoy) for the same token streams asked for through `/v1/chat/completions`, `/v1/messages` "
         "(vLLM's Anthropic converter over the chat stream) and `/v1/responses` (vLLM's Responses server, "
         "driven as a task per request). Same server, interleaved by length."),
        "",
        *table(["tokens per stream", "chat us/token", "messages us/token", "responses us/token",
                "messages / chat", "responses / chat"], rows),
        "",
    ]


def paced_sections(plan: dict, load: dict) -> list[str]:
    """Section 1b: many streams at once, paced as a GPU decodes; one table per concurrency, then the
    ratios the cost-per-token target is about (Envoy + ext_proc CPU per token)."""
    out: list[str] = []
    for concurrency, runs in load.items():
        echo = runs.get("echo", {}).get("tokens_per_s")
        out += [
            (f"## 1b. Under load: {concurrency} concurrent streams, {plan['load_tokens']} tokens each, "
            f"each paced at {1 / plan['load_delay']:.0f} tokens/s (offered {int(concurrency) / plan['load_delay']:,.0f} tokens/s)"),
            "",
            (f"Every path ran {plan.get('load_rounds', 1)} times, the paths interleaved; each row is its median round "
             "by tokens/s (the last column gives every round)."),
            "",
        ]
        rows = []
        for name, run in runs.items():
            rows.append([
                NAMES.get(name, name),
                num(run["tokens_per_s"]),
                f"{run['tokens_per_s'] / echo * 100:.0f} %" if echo and name != "envoy" else "",
                num(run["cpu_us_per_token"].get("server")),
                num(run["cpu_us_per_token"].get("envoy")),
                num(run.get("msgs_to_server_per_token"), 2),
                num(run.get("msgs_from_server_per_token"), 2),
                ms(run["read_gap"]["p50"]),
                ms(run["read_gap"]["p99"]),
                "/".join(f"{x * 100:.0f}" for x in run.get("worker_share", [])) or "-",
                str(run["failed"]),
                " / ".join(num(x) for x in run.get("rounds_tokens_per_s", [run["tokens_per_s"]])),
            ])
        out += table(
            ["path", "tokens/s", "vs echo floor", "ext_proc CPU us/token", "Envoy CPU us/token", "msgs to ext_proc /token",
             "replies /token", "p50 gap between reads ms", "p99 gap ms", "CPU split over workers %", "failed streams",
             "rounds tokens/s"],
            rows,
        )
        out += paced_ratios(runs)
    return out


def paced_ratios(runs: dict) -> list[str]:
    """Envoy + ext_proc CPU per token of each filter row against vLLM's coupled server and against chat."""
    def total(name: str) -> float | None:
        run = runs.get(name)
        if not run:
            return None
        cpu = run["cpu_us_per_token"]
        return (cpu.get("server") or 0) + (cpu.get("envoy") or 0)

    coupled, chat = total("vllm-coupled"), total("hermes")
    lines, any_paired = [], False
    for name in ("envoy", "echo", "echo-grpcio", "hermes", "hermes-grpcio", "hermes-vllm", "hermes-messages", "hermes-responses"):
        mine = total(name)
        if mine is None:
            continue
        parts = [f"{mine / coupled:.2f}x vLLM coupled" if coupled else "",
                 f"{mine / chat:.2f}x chat" if chat and name.startswith("hermes-") and name != "hermes-vllm" else ""]
        if coupled and (paired := paired_ratios(runs.get(name, {}), runs.get("vllm-coupled", {}))):
            parts.append(f"paired rounds {' / '.join(f'{x:.2f}' for x in paired)} (median "
                         f"**{statistics.median(paired):.2f}x**)")
            any_paired = True
        # Messages and Responses against the coupled server asked through the same API (vLLM's own
        # Anthropic converter and Responses server on the same token streams).
        api = name.removeprefix("hermes-")
        same = total(f"vllm-coupled-{api}") if api in ("messages", "responses") else None
        if same:
            parts.append(f"{mine / same:.2f}x vLLM coupled on /v1/{api}")
            if paired := paired_ratios(runs.get(name, {}), runs.get(f"vllm-coupled-{api}", {})):
                parts.append(f"paired rounds {' / '.join(f'{x:.2f}' for x in paired)} (median "
                             f"**{statistics.median(paired):.2f}x** on /v1/{api})")
        parts = [p for p in parts if p]
        if parts:
            what = "Envoy" if name == "envoy" else "Envoy + ext_proc"
            lines.append(f"- {NAMES.get(name, name)}: {what} {mine:.0f} us/token, " + ", ".join(parts))
    for api in ("messages", "responses"):
        same = total(f"vllm-coupled-{api}")
        if same and coupled:
            lines.append(f"- {NAMES[f'vllm-coupled-{api}']}: {same:.0f} us/token, {same / coupled:.2f}x its chat")
    if any_paired:
        lines += ["", "The first ratio is the two median rounds' (by tokens/s). The paired rounds divide each round's "
                  "Envoy + ext_proc CPU per token by the coupled server's in the same round (the paths ran one after "
                  "another within a round), in the order they ran: a slow spell of the machine weighs on both sides "
                  "of a pair."]
    return [*lines, ""] if lines else []


def paired_ratios(mine: dict, coupled: dict) -> list[float]:
    """Round i's Envoy + ext_proc CPU per token over the coupled server's in round i (runs from before
    the rounds' CPU was kept: none)."""
    def totals(run: dict) -> list[float]:
        return [(cpu.get("server") or 0) + (cpu.get("envoy") or 0) for cpu in run.get("rounds_cpu_us_per_token", [])]

    a, b = totals(mine), totals(coupled)
    if len(a) < 2 or len(a) != len(b):
        return []
    return [x / y for x, y in zip(a, b) if y]


def paced_markdown(r: dict) -> str:
    """The report of a ``--only paced`` run."""
    env = r.get("env", {})
    lockstep = r.get("plan", {}).get("lockstep", False)
    out = env.get("out_name") or ("PACED_LOCKSTEP.md" if lockstep else "PACED.md")
    head = [
        "# derender benchmark: production pacing, chat, Messages and Responses",
        "",
        f"Run {env.get('date', '')} on {env.get('cpus', '?')} CPUs ({env.get('cpu', '')}), `--workers {env.get('workers')}` "
        f"for the filter, Envoy `--concurrency {env.get('envoy_concurrency', 2)}`; command: `.venv/bin/python bench/run.py "
        f"--only paced{' --lockstep' if lockstep else ''}{paced_knobs(env)} --out bench/{out}`. The same qwen3 + hermes reasoning + tool-call token streams, one token per producer event, "
        "asked through /v1/chat/completions, /v1/messages and /v1/responses of one filter, beside Envoy alone (the "
        "producer's own request, no ext_proc), the echo ext_proc and vLLM's coupled API server (`bench/coupled_vllm.py`) paced the same. Envoy reaches the filter and "
        "the echo ext_proc on Unix sockets, as `derender up` does (`--filter-socket unix`), and the grpc.aio "
        "ones on loopback TCP. The filter runs its default `--response-leg auto` and its Envoy has the leg's config, as "
        "`derender up` writes it: each worker reaches the producer itself, no ext_proc message per event (the grpc.aio "
        "filter's Envoy has no leg: ext_proc for every event). Pacing: "
        + ("**lockstep**: one engine step every 20 ms for every stream at once, as one GPU decodes its whole batch "
           "(the simulator's and the coupled engine's `StepClock`)." if lockstep else
           "each stream's events 20 ms apart on a timer of its own (streams out of step with each other)."),
        "",
    ]
    return "\n".join(head + paced_sections(r.get("plan", {}), r.get("throughput", {})))


def agents_markdown(r: dict) -> str:
    """The report of a ``--only agents`` run."""
    env = r.get("env", {})
    head = [
        "# derender benchmark: the agent APIs",
        "",
        f"Run {env.get('date', '')} on {env.get('cpus', '?')} CPUs; command: "
        "`.venv/bin/python bench/run.py --only agents --out bench/AGENTS.md`.",
        "",
    ]
    return "\n".join(head + agent_rows(r))


def targets(r: dict) -> list[str]:
    lines = []
    lengths = {int(k): v for k, v in r.get("lengths", {}).items()}
    vllm = {int(k): v for k, v in r.get("vllm_derender", {}).items()}
    if len(lengths) >= 2:
        short, long = min(lengths), max(lengths)
        a, b = lengths[short]["cpu_us_per_token"]["server"], lengths[long]["cpu_us_per_token"]["server"]
        lines.append(f"- Our CPU per token at {long} tokens / at {short}: **{b / a:.2f}x** (target <= 1.25x): {check(b / a <= 1.25)}")
    if vllm and lengths:
        long = max(set(lengths) & set(vllm))
        ratio = vllm[long]["cpu_us_per_token"] / lengths[long]["cpu_us_per_token"]["server"]
        lines.append(f"- vLLM's streaming derender / ours, CPU per token at {long} tokens: **{ratio:,.0f}x** "
                     f"(target >= 50x): {check(ratio >= 50)}")
    coupled = {n: run["coupled"]["cpu_us_per_token"]["server"] / run["cpu_us_per_token"]["server"]
               for n, run in lengths.items() if run.get("coupled")}
    if coupled:
        lines.append("- vLLM's coupled API server / ours, CPU per token (no target yet): "
                     + ", ".join(f"{n} tokens **{x:.2f}x**" for n, x in sorted(coupled.items())))
    load = r.get("throughput", {})
    if load:
        top = max(load, key=int)
        runs = load[top]
        echo = runs.get("echo", {}).get("tokens_per_s")
        for name in ("hermes", "plain"):
            if echo and name in runs:
                share = runs[name]["tokens_per_s"] / echo
                lines.append(f"- Throughput at {top} streams, {NAMES[name]} / echo floor: **{share * 100:.0f} %** "
                             f"(target >= 70 %): {check(share >= 0.7)}")
    latency = r.get("latency", {})
    if "envoy" in latency:
        floor = latency["envoy"]["latency"]["p50"]
        for name in ("hermes", "plain"):
            if name in latency:
                added = latency[name]["latency"]["p50"] - floor
                lines.append(f"- Added p50 latency per token at low load, {NAMES[name]}: **{added * 1e3:.2f} ms** "
                             f"(target <= 1.5 ms): {check(added <= 0.0015)}")
    for t in r.get("ttft", {}).values():
        added, render = t["ours"] - t["envoy"], t.get("ours_render")
        if render is not None:
            lines.append(f"- TTFT added by rendering, {t['prompt_tokens']}-token prompt: {render * 1e3:.1f} ms vs vLLM "
                         f"/render {t['vllm_render'] * 1e3:.1f} ms: {check(render <= t['vllm_render'])}")
        lines.append(f"- TTFT added by the filter in all, {t['prompt_tokens']}-token prompt: {added * 1e3:.1f} ms vs vLLM "
                     f"/render {t['vllm_render'] * 1e3:.1f} ms: {check(added <= t['vllm_render'])}")
    return lines + [""]


def fds_note(r: dict) -> list[str]:
    load = r.get("throughput", {})
    if not load:
        return []
    lines = ["## STREAMED vs FULL_DUPLEX_STREAMED (response body mode)", ""]
    for concurrency, runs in load.items():
        if "hermes" in runs and "hermes-fds" in runs:
            s, f = runs["hermes"], runs["hermes-fds"]
            lines.append(
                f"- {concurrency} streams: STREAMED {s['tokens_per_s']:,.0f} tokens/s, "
                f"{s['cpu_us_per_token'].get('server', 0):.0f} us CPU/token, {s.get('msgs_from_server_per_token', 0):.2f} "
                f"replies/token; FDS {f['tokens_per_s']:,.0f} tokens/s, {f['cpu_us_per_token'].get('server', 0):.0f} us "
                f"CPU/token, {f.get('msgs_from_server_per_token', 0):.2f} replies/token "
                f"(FDS / STREAMED throughput {f['tokens_per_s'] / s['tokens_per_s']:.2f}x)"
            )
    latency = r.get("latency", {})
    if "hermes" in latency and "hermes-fds" in latency:
        lines.append(
            f"- low load: p50 latency per token STREAMED {ms(latency['hermes']['latency']['p50'])} ms, "
            f"FDS {ms(latency['hermes-fds']['latency']['p50'])} ms"
        )
    return lines + [""]


def paced_knobs(env: dict) -> str:
    """The command-line options a paced run was given beyond the defaults (workers, Envoy's threads)."""
    knobs = ""
    if env.get("default_workers") and env.get("workers") != env["default_workers"]:
        knobs += f" --workers {env['workers']}"
    if env.get("envoy_concurrency", 2) != env.get("default_envoy_concurrency", 2):
        knobs += f" --envoy-concurrency {env['envoy_concurrency']}"
    if env.get("rounds"):
        knobs += f" --rounds {env['rounds']}"
    if env.get("tokens"):
        knobs += f" --tokens {env['tokens']}"
    return knobs
