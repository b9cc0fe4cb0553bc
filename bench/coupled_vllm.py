"""vLLM 0.33.0's coupled API server with the GPU engine replaced by the benchmark's script.

The benchmark's anchor for "why not run vLLM coupled": the app ``vllm serve`` builds
(``build_app`` + ``init_app_state``: FastAPI, uvicorn, ``OpenAIServingChat``, the
renderer, the output processor's incremental detokenizer, the reasoning and tool
parsers) on an engine client that hands it the same token streams the simulator
sends to the filter, one token per engine step, ``--delay`` seconds apart. The
engine is ``tests/reference.py``'s ``ScriptedEngine`` (the parity oracle's), which
runs vLLM's ``InputProcessor`` and ``OutputProcessor`` as ``AsyncLLM`` does; what a
real API server process does beside it (ZMQ + msgpack decoding of the engine core's
outputs) is not here, so this process's CPU is a lower bound for vLLM's.

    python bench/coupled_vllm.py --model DIR --port 8300 --script FILE --delay 0.02 \\
        --served-model-name qwen3 --reasoning-parser qwen3 --tool-call-parser hermes --enable-auto-tool-choice

``POST /bench/delay {"delay": s, "lockstep": bool}`` changes the pacing (lockstep: every
request's step on one shared clock, as the simulator's ``--lockstep``); the script (the simulator's
JSONL, first line) is re-read on every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from derender.sim.generation import StepClock  # noqa: E402
from reference import ScriptedEngine, Step  # noqa: E402
from starlette.requests import Request  # noqa: E402


class BenchEngine(ScriptedEngine):
    """The script as an ``EngineClient``: what ``init_app_state`` and the serving classes ask of one."""

    dead_error = RuntimeError("engine dead")
    is_running = True
    is_stopped = False

    def __init__(self, vllm_config: Any, renderer: Any, script: Path, delay: float) -> None:
        super().__init__(vllm_config, renderer, [])
        self.script = script
        self.delay = delay
        self.lockstep = False
        self.clock = StepClock()
        self.io_processor = None

    async def pause(self) -> None:
        if self.lockstep and self.delay > 0:
            await self.clock.wait(1, self.delay)
        else:
            await asyncio.sleep(self.delay)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        line = json.loads(self.script.read_text().splitlines()[0])
        ids = line["token_ids"]
        last = len(ids) - 1
        self.steps = [Step(0, [t], line["finish_reason"] if i == last else None) for i, t in enumerate(ids)]
        async for output in super().generate(prompt, sampling_params, request_id, **kwargs):
            yield output

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def check_health(self) -> None:
        return None

    async def do_log_stats(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def abort(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def is_sleeping(self) -> bool:
        return False

    async def is_paused(self) -> bool:
        return False


def build(argv: list[str]) -> tuple[Any, argparse.Namespace]:
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.renderers import renderer_from_config
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    parser.add_argument("--script", required=True, help="the simulator's JSONL script (first line: one choice)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between engine steps")
    args = parser.parse_args(argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None
    vllm_config = VllmConfig(model_config=model_config, structured_outputs_config=engine_args.create_structured_outputs_config())
    args.structured_outputs_config = vllm_config.structured_outputs_config
    engine = BenchEngine(vllm_config, renderer_from_config(vllm_config), Path(args.script), args.delay)
    app = build_app(args, ("generate",), model_config)

    async def set_delay(request: Request) -> dict:
        knobs = await request.json()
        engine.delay = float(knobs["delay"])
        engine.lockstep = bool(knobs.get("lockstep", engine.lockstep))
        return {"delay": engine.delay, "lockstep": engine.lockstep}

    app.add_api_route("/bench/delay", set_delay, methods=["POST"])
    asyncio.run(init_app_state(engine, app.state, args, ("generate",)))
    return app, args


def main() -> int:
    import uvicorn

    app, args = build(sys.argv[1:])
    config = uvicorn.Config(app, host=args.host or "127.0.0.1", port=args.port, log_level="warning",
                            access_log=False, loop="uvloop", backlog=4096)
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
