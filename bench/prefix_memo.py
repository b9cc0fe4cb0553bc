"""What the prefix memo saves an agent: render CPU per turn of a growing conversation, memo on and off.

An agent (Claude Code, Codex CLI) re-sends its long system prompt, its tools and the whole
conversation on every turn. Three renderers, in this process, render the same turns interleaved:
the filter's (``derender.translate.prefixmemo`` installed), the filter's without the memo (long
prompts tokenized in pieces on two threads, as before it) and vLLM's own renderer untouched. The
figure is process CPU (every thread: vLLM tokenizes on its executor thread) and wall time per
``render_chat`` call, the median over ``--repeat`` runs of each turn; the three prompts' ids are
compared on every turn.

    .venv/bin/python bench/prefix_memo.py [--system-kb 60] [--turns 20] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from derender.ops import assets

RULE = "Rule {k}: read the file before you edit it, keep the diff small and run the tests after each change. "


def conversation(system_kb: int, turns: int) -> list[dict]:
    """The chat bodies of an agent's turns: each one the previous plus a tool call and its result."""
    system = "".join(RULE.format(k=k) for k in range(system_kb * 1024 // len(RULE)))
    tools = [{"type": "function", "function": {
        "name": f"tool_{k}", "description": f"Tool {k}: " + "Reads, searches or edits files in the workspace. " * 12,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}}}
        for k in range(16)]
    messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test."}]
    bodies = []
    for turn in range(turns):
        bodies.append({"model": "qwen3", "messages": messages, "tools": tools, "max_tokens": 256})
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "tool_1", "arguments": json.dumps({"path": f"src/module_{turn}.py"})}}
        result = "".join(f"{n:4d}  def function_{turn}_{n}(x):  return x * {n}\n" for n in range(30))
        messages = [*messages, {"role": "assistant", "content": f"Reading module {turn}.", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{turn}", "content": result}]
    return bodies


def models(model_dir: str) -> dict:
    from derender.translate import prefixmemo
    from derender.translate.model import Model, ModelSpec
    from vllm.utils.async_utils import make_async

    spec = ModelSpec(model=model_dir, served_model_name=("qwen3",), max_model_len=40960,
                     tool_call_parser="hermes", enable_auto_tool_choice=True)
    memo = Model(spec)
    boundaries = prefixmemo.boundaries
    prefixmemo.boundaries = lambda tokenizer: []  # type: ignore[assignment]  # this one without the memo
    try:
        pieces = Model(spec)
    finally:
        prefixmemo.boundaries = boundaries  # type: ignore[assignment]
    plain = Model(spec)
    plain.renderer.__dict__.pop("_tokenize_prompt")  # vLLM's own method again
    plain.renderer._tokenize_prompt_async = make_async(plain.renderer._tokenize_prompt, executor=plain.renderer._executor)
    return {"memo": memo, "pieces": pieces, "vllm": plain}


async def render(model, raw: bytes) -> tuple[float, float, list[int]]:
    from derender.translate.render import render_chat

    cpu, wall = time.process_time(), time.perf_counter()
    ids = (await render_chat(model, raw, None)).prompt_token_ids
    return time.process_time() - cpu, time.perf_counter() - wall, ids


def clear_memos(renderers: dict) -> None:
    for model in renderers.values():
        if model.prompt_memo is not None:
            model.prompt_memo.clear()


async def measure(renderers: dict, bodies: list[dict], repeat: int) -> list[dict]:
    """Each repeat is the whole conversation again with an empty memo; a turn's figure is its median."""
    cpu: dict[tuple[int, str], list[float]] = {}
    wall: dict[tuple[int, str], list[float]] = {}
    prompts: dict[tuple[int, str], list[int]] = {}
    for _ in range(repeat):
        clear_memos(renderers)
        for turn, body in enumerate(bodies):
            raw = json.dumps(body).encode()
            for name, model in renderers.items():
                c, w, ids = await render(model, raw)
                cpu.setdefault((turn, name), []).append(c)
                wall.setdefault((turn, name), []).append(w)
                prompts[turn, name] = ids
    rows = []
    for turn in range(len(bodies)):
        same = len({tuple(prompts[turn, name]) for name in renderers}) == 1
        rows.append({"turn": turn + 1, "prompt_tokens": len(prompts[turn, "vllm"]), "same_ids": same,
                     **{f"{name}_cpu_ms": statistics.median(cpu[turn, name]) * 1e3 for name in renderers},
                     **{f"{name}_wall_ms": statistics.median(wall[turn, name]) * 1e3 for name in renderers}})
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} CPUs; command: `{command}`.", "",
             "| turn | prompt tokens | memo CPU ms | pieces CPU ms | vLLM CPU ms | memo wall ms | vLLM wall ms | memo / vLLM CPU | same ids |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']:,} | {r['memo_cpu_ms']:.1f} | {r['pieces_cpu_ms']:.1f} | "
                     f"{r['vllm_cpu_ms']:.1f} | {r['memo_wall_ms']:.1f} | {r['vllm_wall_ms']:.1f} | "
                     f"{r['memo_cpu_ms'] / r['vllm_cpu_ms']:.2f} | {'yes' if r['same_ids'] else 'NO'} |")
    later = rows[1:]
    total = {k: sum(r[f"{k}_cpu_ms"] for r in later) for k in ("memo", "pieces", "vllm")}
    lines += ["", f"Turns 2-{len(rows)} together: memo {total['memo']:.0f} ms of CPU, pieces {total['pieces']:.0f} ms, "
              f"vLLM {total['vllm']:.0f} ms (memo / vLLM {total['memo'] / total['vllm']:.2f}x)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-kb", type=int, default=60, help="the system prompt's size (Claude Code's is some 60 KB)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the table here as well")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    renderers = models(str(assets.fetch("qwen3", quiet=True)))
    bodies = conversation(args.system_kb, args.turns)
    asyncio.run(measure(renderers, bodies[:2], 1))  # warm up
    rows = asyncio.run(measure(renderers, bodies, args.repeat))
    text = markdown(rows, "python bench/prefix_memo.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        Path(args.out).write_text("# derender benchmark: the prefix memo\n\n" + text)
    return 0 if all(r["same_ids"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
