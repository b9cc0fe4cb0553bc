"""The two paths of the parity suite, per model config: the filter behind the real Envoy
(with the simulator as producer) and vLLM's coupled chat server in process (``reference``).

Both get the same ``vllm serve`` flags. Model configs are served one after the other, the
next one starting in the background while the current one's cases run.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from derender.ops import assets
from parity_cases import ANSWERS, Answers
from reference import CoupledChat
from stack import Stack

# The flags `vllm serve` gets for each model config (asset name -> flags). gpt-oss takes the
# Harmony path by its model_type; its parsers are named as vLLM's gpt-oss recipe names them.
MODELS = {
    "qwen3": ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
    "deepseek-r1": ["--reasoning-parser", "deepseek_r1"],
    "gpt-oss": ["--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai", "--enable-auto-tool-choice"],
    "qwen3-no-parser": [],  # vLLM's default: no reasoning or tool parser
    # A vision-language model (a tiny Qwen2-VL with the Qwen3 tokenizer): its cases carry an image.
    "qwen2-vl": ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
}
ASSET = {"qwen3-no-parser": "qwen3"}  # model configs that share a tokenizer
MAX_MODEL_LEN = "8192"


@dataclass
class Served:
    name: str
    stack: Stack
    reference: CoupledChat
    answers: Answers
    script: Path


def serve(name: str, tmp: Path) -> Served:
    """One Envoy + filter + simulator and one coupled reference for a model config."""
    model_dir = str(assets.fetch(ASSET.get(name, name)))
    flags = ["--served-model-name", name, "--max-model-len", MAX_MODEL_LEN, *MODELS[name]]
    script = tmp / "script.jsonl"
    script.write_text("")
    stack = Stack(model_dir, flags, ["--mode", "script", "--script", str(script)])
    failed: list[BaseException] = []

    def start() -> None:
        try:
            stack.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failed.append(exc)

    starter = threading.Thread(target=start)
    starter.start()  # the processes start while the reference loads here
    try:
        reference = CoupledChat(model_dir, *flags)
        answers = ANSWERS[name](model_dir)
    except BaseException:
        starter.join()
        stack.stop()
        raise
    starter.join()
    if failed:
        raise failed[0]
    return Served(name, stack, reference, answers, script)


class Servers:
    """Serves the model configs in the order the tests need them, one after the other.

    While one model's cases run, the next model's stack and reference start in the
    background (their start-up is mostly waiting on other processes and loading
    tokenizers, and the cases leave a core idle).
    """

    def __init__(self, tmp_path_factory, order: list[str]) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.order = order
        self.current: Served | None = None
        self.pending: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity-serve")

    def get(self, name: str) -> Served:
        if self.current is not None and self.current.name == name:
            return self.current
        self._stop(self.current)
        self.current = None
        self._start(name)
        if name in self.order and (i := self.order.index(name)) + 1 < len(self.order):
            self._start(self.order[i + 1])
        self.current = self.pending[name].result()  # a failed start raises here, for each of its cases
        return self.current

    def close(self) -> None:
        self._stop(self.current)
        for future in self.pending.values():
            if future.exception() is None:
                self._stop(future.result())
        self.pool.shutdown()

    def _start(self, name: str) -> None:
        if name not in self.pending:
            self.pending[name] = self.pool.submit(serve, name, self.tmp_path_factory.mktemp(f"parity-{name}"))

    @staticmethod
    def _stop(served: Served | None) -> None:
        if served is not None:
            served.stack.stop()


# -- requests --------------------------------------------------------------------------------
def sse(lines) -> list:
    return [
        "[DONE]" if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in lines if line.startswith("data: ")
    ]


def through_envoy(served: Served, body: dict, path: str = "/chat/completions", events=None) -> list | dict:
    """``body`` to ``path`` through Envoy: the JSON answer, or the stream's events (``events``
    parses the SSE text; default: chat's ``data:`` payloads)."""
    url = served.stack.base_url + path
    if not body.get("stream"):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        if events is not None:
            return events(r.read().decode())
        return sse(r.iter_lines())


def through_sdk(served: Served, body: dict) -> list:
    from openai import OpenAI

    client = OpenAI(base_url=served.stack.base_url, api_key="unused", max_retries=0, timeout=60)
    standard = {"messages", "model", "stream", "n", "tools", "tool_choice", "logprobs", "top_logprobs",
                "stream_options", "max_tokens", "parallel_tool_calls", "stop"}
    extra = {k: v for k, v in body.items() if k not in standard}
    kwargs = {k: v for k, v in body.items() if k in standard}
    return [chunk.model_dump(exclude_unset=True) for chunk in client.chat.completions.create(**kwargs, extra_body=extra)] + ["[DONE]"]


def producer_steps(served: Served, generate_request: dict) -> list[tuple]:
    """What the simulator sends for a GenerateRequest: (index, token_ids, finish_reason, stop_reason) per event."""
    with httpx.stream("POST", served.stack.sim_url + "/inference/v1/generate", json=generate_request, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = sse(r.iter_lines())
    return [
        (c["index"], c["token_ids"], c["finish_reason"], c["stop_reason"])
        for e in events if isinstance(e, dict) for c in e["choices"]
    ]
