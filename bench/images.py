"""Images through the filter: body sizes, filter CPU and time to first token per image, beside vLLM's render.

A tiny Qwen2-VL (``assets.fetch("qwen2-vl")``; the image processor is Qwen2-VL's own, the weights do
not matter to the filter) served by the simulator, the filter (one worker) and Envoy on loopback.
Each size is sent as ``--images`` different pictures (new to vLLM's processor cache), then the last
one again (a cache hit), one request at a time, streamed, one answer token: so the filter's CPU
between two requests is what one image costs it. Beside it, in this process, vLLM's own
``ServingRender.render_chat_request`` (what ``/v1/chat/completions/render`` of vLLM's render
server runs) renders the same requests: the floor any gateway pays that renders an image as vLLM
does. Writes ``bench/IMAGES.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import procs
from PIL import Image

from derender.ops import assets

BENCH = Path(__file__).resolve().parent
SIZES = [(256, "JPEG"), (512, "JPEG"), (1024, "JPEG"), (1024, "PNG"), (1536, "JPEG"), (2048, "JPEG"), (4096, "JPEG")]


def picture(side: int, fmt: str, seed: int) -> bytes:
    """A photo-like picture: a fractal with noise (JPEG ~0.35 bytes a pixel at quality 90)."""
    image = Image.effect_mandelbrot((side, side), (-2 + seed * 0.01, -1.5, 1, 1.5), 100).convert("RGB")
    image = Image.blend(image, Image.effect_noise((side, side), 30 + seed).convert("RGB"), 0.3)
    buf = io.BytesIO()
    image.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def request(raw: bytes, fmt: str) -> dict:
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(raw).decode()
    return {"model": "vl", "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe the picture."}, {"type": "image_url", "image_url": {"url": url}}]}]}


def send(url: str, body: bytes) -> tuple[int, float, float]:
    """(status, seconds to the first byte of the answer, seconds to its end)."""
    started = time.perf_counter()
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read(1)
            first = time.perf_counter() - started
            r.read()
            return r.status, first, time.perf_counter() - started
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, time.perf_counter() - started, time.perf_counter() - started


def last_producer_body(sim_url: str) -> int:
    with urllib.request.urlopen(sim_url + "/sim/requests", timeout=60) as r:
        requests = json.loads(r.read())
    return len(json.dumps(requests[-1], separators=(",", ":"))) if requests else 0


def vllm_render_ms(model_dir: str, bodies: list[bytes]) -> list[float]:
    """vLLM's ServingRender on each body in this process, ms each (the filter's Model builds it as vLLM's
    render server does)."""
    from derender.translate.model import Model, ModelSpec
    from derender.translate.render import parse_chat_request

    model = Model(ModelSpec(model=model_dir, served_model_name=("vl",), max_model_len=32768))

    async def run() -> list[float]:
        out = []
        for body in bodies:
            started = time.perf_counter()
            await model.serving_render.render_chat_request(parse_chat_request(model, body), None)
            out.append((time.perf_counter() - started) * 1e3)
        return out

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4, help="different pictures per size (default 4)")
    parser.add_argument("--out", default=str(BENCH / "IMAGES.md"), help="the report ('-': stdout only)")
    args = parser.parse_args()
    procs.exit_on_sigterm()
    model_dir = str(assets.fetch("qwen2-vl"))
    procs.LOGS.mkdir(parents=True, exist_ok=True)
    cases = {(side, fmt): [json.dumps(request(picture(side, fmt, seed), fmt)).encode()
                           for seed in range(args.images)] for side, fmt in SIZES}
    text_only = json.dumps({"model": "vl", "max_tokens": 1, "stream": True, "messages": [
        {"role": "user", "content": "Describe the picture."}]}).encode()
    started: list[procs.Proc] = []
    rows = []
    try:
        sim_port, port = procs.free_port(), procs.free_port()
        sim = procs.Proc("sim-images", [procs.PYTHON, "-m", "derender.cli", "sim", "--model", model_dir,
                                        "--port", str(sim_port)]).start()
        started.append(sim)
        sim.wait(lambda: procs.http_ok(f"http://127.0.0.1:{sim_port}/health"), 120)
        server = procs.Proc("filter-images", [procs.PYTHON, "-m", "derender.cli", "serve", "--model", model_dir,
                                              "--served-model-name", "vl", "--max-model-len", "32768",
                                              "--port", str(port), "--producer", f"http://127.0.0.1:{sim_port}",
                                              "--workers", "1"]).start()
        started.append(server)
        server.wait(lambda: procs.tcp_open(port), 600)
        envoy = procs.start_envoy("envoy-images", sim_port, port)
        started.append(envoy.proc)
        envoy.proc.wait(lambda: procs.http_ok(f"http://127.0.0.1:{envoy.admin}/ready"), 60)
        url = envoy.url + "/v1/chat/completions"
        sim_url = f"http://127.0.0.1:{sim_port}"
        for _ in range(3):
            send(url, text_only)
        text_ttft = statistics.median(send(url, text_only)[1] for _ in range(5)) * 1e3
        rss_before = sum(m["rss"] for m in procs.memory(server))
        for (side, fmt), bodies in cases.items():
            runs = []
            for body in [*bodies, bodies[-1]]:
                cpu = server.cpu(), envoy.proc.cpu()
                status, first, _ = send(url, body)
                runs.append({"status": status, "ttft_ms": first * 1e3, "filter_ms": (server.cpu() - cpu[0]) * 1e3,
                             "envoy_ms": (envoy.proc.cpu() - cpu[1]) * 1e3,
                             "producer_bytes": last_producer_body(sim_url) if status == 200 else 0})
            new, again = runs[:-1], runs[-1]
            rows.append({"side": side, "fmt": fmt, "client_bytes": statistics.median(len(b) for b in bodies),
                         "status": new[0]["status"],
                         "producer_bytes": statistics.median(r["producer_bytes"] for r in new),
                         **{k: statistics.median(r[k] for r in new) for k in ("ttft_ms", "filter_ms", "envoy_ms")},
                         "again_ttft_ms": again["ttft_ms"], "again_filter_ms": again["filter_ms"]})
            print(json.dumps(rows[-1]), flush=True)
        rss_after = sum(m["rss"] for m in procs.memory(server))
    finally:
        for proc in reversed(started):
            proc.stop()
    vllm_ms = {}
    timings = vllm_render_ms(model_dir, [b for bodies in cases.values() for b in [*bodies, bodies[-1]]])
    at = 0
    for key, bodies in cases.items():
        got = timings[at: at + len(bodies) + 1]
        at += len(bodies) + 1
        vllm_ms[key] = (statistics.median(got[:-1]), got[-1])
    lines = [
        "# Images through the filter",
        "",
        f"{datetime.date.today()}, `.venv/bin/python bench/images.py --images {args.images}`: a tiny Qwen2-VL "
        "(Qwen2-VL's image processor) behind the simulator, the filter (one worker) and Envoy on this 2-core "
        f"machine; per size the median of {args.images} different pictures (new to vLLM's processor cache), then "
        "the last again (`again`: a cache hit); one request at a time, streamed, one answer token. Filter and "
        "Envoy CPU are each process's CPU time over one request. `vLLM render` is vLLM's own "
        "`ServingRender.render_chat_request` (what its render server's `/v1/chat/completions/render` runs) on "
        "the same bodies in one process, wall time. 413: the rendered request is larger than "
        "`--max-producer-body-bytes` (16 MiB, Envoy's buffer).",
        "",
        f"Text only, the same prompt without the image: TTFT p50 {text_ttft:.1f} ms. Filter RSS {rss_before:.0f} "
        f"MiB before the images, {rss_after:.0f} MiB after (`--mm-processor-cache-gb 0.5`).",
        "",
        "| image | client body | producer body | status | TTFT ms | filter CPU ms | Envoy CPU ms | vLLM render ms "
        "| again: TTFT ms | again: filter CPU ms | again: vLLM render ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        key = (row["side"], row["fmt"])
        producer = f"{row['producer_bytes'] / 1e6:.2f} MB" if row["producer_bytes"] else "-"
        lines.append(f"| {row['side']}x{row['side']} {row['fmt']} | {row['client_bytes'] / 1e6:.2f} MB | {producer} | "
                     f"{row['status']} | {row['ttft_ms']:.0f} | {row['filter_ms']:.0f} | {row['envoy_ms']:.0f} | "
                     f"{vllm_ms[key][0]:.0f} | {row['again_ttft_ms']:.0f} | {row['again_filter_ms']:.0f} | "
                     f"{vllm_ms[key][1]:.0f} |")
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
