"""The real vLLM engines of ``tests/test_real_vllm.py`` and ``tests/test_real_handoff.py``, started ahead
of their tests in a suite run.

An engine takes about a minute of one core to start (imports, the dummy model, the KV cache).
test_real_vllm.py needs two (the text model with a LoRA adapter, and the VLM), test_real_handoff.py
a pair with vLLM's NIXL connector (``PAIR``). In a suite run (``conftest``: over 300 tests
collected) the engines of the files collected are started in the background at collection, one after
the other and at a lower CPU priority than the tests (``nice``), so that they start while other files
run and take only what the tests leave idle; the files' fixtures take them (``take``) and wait for
whatever of the start is left. A file run alone starts them in its fixtures, as before. Each engine
is stopped by its fixture after the file, and any engine no fixture took at the session's end
(``stop_all``).

With test workers (``pytest -n``, as ``make test`` runs the suite) the engines belong to the
controller, which runs no test: it starts them once the workers report the suite collected, and the
worker that runs the file reaches them through a folder they share (``share``): the adapter, each
engine's address and log once it is spawned (``KIND.json``) or why it failed (``KIND.error``); the
worker asks for an engine's stop (``KIND.stop``) and waits until the controller has stopped it
(``KIND.stopped``).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from stack import ROOT, Proc, free_port, http_ok, wait_for

SETUP = ROOT / "tests" / "real_vllm" / "setup.sh"
# Flags the engine and the filter share: what the model is called and how long it may be.
MODEL_FLAGS = ["--served-model-name", "qwen3", "--max-model-len", "1024"]
VL_FLAGS = ["--served-model-name", "vl", "--max-model-len", "2048"]
# Engine-only flags: random weights in the model folder's config, no compilation,
# the producer API, and a small explicit KV cache (the CPU backend otherwise wants
# 92% of the memory free at start-up).
ENGINE_FLAGS = ["--load-format", "dummy", "--enforce-eager", "--enable-scale-out", "--kv-cache-memory-bytes", "64M"]
READY_S = 600.0  # an engine that is not healthy by then has failed


def build_venv() -> Path:
    done = subprocess.run(["bash", str(SETUP)], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{SETUP} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def write_adapter(folder: Path) -> Path:
    """A LoRA adapter for the tiny Qwen3 (one layer, hidden 64): rank 8 on q, v and o, random non-zero
    weights (seeded) large enough to change a greedy answer (dummy base weights are tiny)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name, inputs, outputs in (("q_proj", 64, 64), ("v_proj", 64, 32), ("o_proj", 64, 64)):
        prefix = f"base_model.model.model.layers.0.self_attn.{name}"
        tensors[prefix + ".lora_A.weight"] = torch.randn(8, inputs, generator=g).to(torch.bfloat16)
        tensors[prefix + ".lora_B.weight"] = torch.randn(outputs, 8, generator=g).to(torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"],
        "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False,
        "base_model_name_or_path": "qwen3"}))
    return folder


_FOLDER: list[Path] = []
_SHARED: list[Path] = []  # with test workers: the folder the controller and the workers share


def share(folder: str | Path) -> None:
    """With test workers: the folder through which the controller lends the workers its engines."""
    _SHARED[:] = [Path(folder)]


def _lent(kind: str) -> Path | None:
    """In a worker: the shared folder, if the controller started that engine."""
    if _SHARED and not _AHEAD and (marker := _SHARED[0] / "prestarted").exists():
        return _SHARED[0] if kind in marker.read_text().split() else None
    return None


@functools.cache
def adapter() -> tuple[str, ...]:
    """``--lora-modules`` for the engine and the filter alike (one adapter per session; with workers,
    the controller's, in the shared folder)."""
    if _SHARED and _AHEAD:  # the controller, starting the engines
        folder = write_adapter(_SHARED[0] / "lora" / "my-lora")
    elif (lent := _lent("text")) is not None:  # a worker: the folder the controller writes
        folder = lent / "lora" / "my-lora"
        wait_for(lambda: (folder / "adapter_config.json").exists(), "the controller's adapter", READY_S)
    else:
        _FOLDER.append(Path(tempfile.mkdtemp(prefix="derender-lora-")))
        folder = write_adapter(_FOLDER[0] / "my-lora")
    return ("--lora-modules", f"my-lora={folder}")


def _qwen3_dir() -> str:
    from derender.ops import assets

    return str(assets.fetch("qwen3", quiet=True))


def _vl_dir() -> str:
    from derender.ops import assets

    return str(assets.fetch("qwen2-vl", quiet=True))


def kv_events() -> tuple[str, str]:
    """The text engine's KV cache events: its PUB and replay sockets (Unix sockets beside the adapter,
    in the folder the controller and the workers share)."""
    folder = Path(adapter()[1].split("=", 1)[1]).parent
    return f"ipc://{folder}/kv-events", f"ipc://{folder}/kv-events-replay"


# The prefill/decode pair (tests/test_real_handoff.py): the plain Qwen3, each with vLLM's NixlConnector on a
# CPU buffer, able to prefill for the other or to decode from the other's KV.
PAIR = ("prefill", "decode")
CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def flags(kind: str) -> list[str]:
    """The engine's command line after ``python``: "text" (Qwen3 with the adapter, publishing its KV cache
    events), "vl" (Qwen2-VL) or one of the ``PAIR``."""
    if kind in PAIR:
        return ["--model", _qwen3_dir(), *MODEL_FLAGS, "--kv-transfer-config", json.dumps(CONNECTOR)]
    if kind == "text":
        pub, replay = kv_events()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
        return ["--model", _qwen3_dir(), *MODEL_FLAGS, "--enable-lora", "--max-lora-rank", "8", *adapter(),
                "--kv-events-config", json.dumps(events)]
    return ["--model", _vl_dir(), *VL_FLAGS, "--limit-mm-per-prompt", '{"image": 1, "video": 0}']


def environment(kind: str, venv: Path) -> dict[str, str]:
    """What the engine's environment adds: for the pair, NIXL (setup.sh's folder) and the side channel on
    which a decode engine asks the prefill engine for its KV's layout (a port of its own)."""
    if kind not in PAIR:
        return {}
    # UCX_RCACHE_MAX_UNRELEASED: what vLLM sets before it imports NIXL, which the folder's sitecustomize
    # (the agents without their busy progress thread) imports first.
    return {"PYTHONPATH": str(venv / "nixl"), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_RCACHE_MAX_UNRELEASED": "1024"}


class Engine:
    """One engine: its process and base URL once spawned (``spawned`` set; ``error`` if it could not be)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.proc: Proc | None = None
        self.url = ""
        self.error: BaseException | None = None
        self.spawned = threading.Event()
        self.taken = False

    def spawn(self, nice: bool) -> None:
        try:
            venv = build_venv()
            port = free_port()
            argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", *flags(self.kind),
                    *ENGINE_FLAGS, "--host", "127.0.0.1", "--port", str(port)]
            self.proc = Proc(f"vllm-cpu-{self.kind}", ["nice", "-n", "10", *argv] if nice else argv,
                             env=environment(self.kind, venv)).start()
            self.url = f"http://127.0.0.1:{port}"
        except BaseException as exc:  # noqa: BLE001 - the fixture raises it
            self.error = exc
        finally:
            self.spawned.set()

    def ready(self) -> tuple[Proc, str]:
        """The engine once healthy (its start failed: raised)."""
        self.spawned.wait()
        if self.error is not None:
            raise self.error
        assert self.proc is not None
        self.proc.wait(lambda: http_ok(self.url + "/health"), READY_S)
        return self.proc, self.url

    def stop(self) -> None:
        self.spawned.wait()
        if self.proc is not None:
            self.proc.stop()


_AHEAD: dict[str, Engine] = {}
_STOPPING = threading.Event()


# The engines each test file takes, in the order they are started ahead.
KINDS = {"test_real_vllm.py": ("text", "vl"), "test_real_handoff.py": PAIR}


def kinds_of(files: Iterable[str]) -> list[str]:
    """The engines the test files named in ``files`` (paths or node ids) take."""
    names = {Path(f.split("::", 1)[0]).name for f in files}
    return [kind for name, kinds in KINDS.items() if name in names for kind in kinds]


def prestart(kinds: Sequence[str]) -> None:
    """Start these engines in the background, one after the other (a suite run: at collection; with
    workers, in the controller, which then answers the workers' stop requests)."""
    if _AHEAD or not kinds:
        return
    engines = [Engine(kind) for kind in kinds]
    _AHEAD.update({e.kind: e for e in engines})
    shared = _SHARED[0] if _SHARED else None
    if shared is not None:
        _write(shared / "prestarted", " ".join(kinds))

    def run() -> None:
        for engine in engines:
            if _STOPPING.is_set():  # the session is over: nothing more to start
                engine.spawned.set()
                continue
            engine.spawn(nice=True)
            # The next one starts when this one is up; if it failed, its fixture meets the failure.
            try:
                if shared is not None:
                    _publish(engine, shared)
                engine.ready()
            except BaseException as exc:  # noqa: BLE001 - the fixture raises it
                if shared is not None:
                    _write(shared / f"{engine.kind}.error", f"{type(exc).__name__}: {exc}")

    def answer_stops(shared: Path) -> None:  # the workers' requests, while engines start too
        while not _STOPPING.wait(0.5):
            for engine in engines:
                if not engine.taken and (shared / f"{engine.kind}.stop").exists():
                    engine.taken = True
                    engine.stop()
                    _write(shared / f"{engine.kind}.stopped", "")

    threading.Thread(target=run, name="real-engines", daemon=True).start()
    if shared is not None:
        threading.Thread(target=answer_stops, args=(shared,), name="real-engines-stops", daemon=True).start()


def _write(path: Path, text: str) -> None:
    """``text`` at ``path``, whole or not at all (a worker polls for it)."""
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").rename(path)


def _publish(engine: Engine, shared: Path) -> None:
    if engine.error is not None:
        raise engine.error
    assert engine.proc is not None and engine.proc.log is not None
    _write(shared / f"{engine.kind}.json", json.dumps({"url": engine.url, "log": str(engine.proc.log)}))


class LentProc:
    """A worker's view of the controller's engine: its name and log (what the tests read)."""

    def __init__(self, name: str, log: Path) -> None:
        self.name = name
        self.log = log


def _take_lent(kind: str, shared: Path):
    spawned, failed = shared / f"{kind}.json", shared / f"{kind}.error"
    try:
        wait_for(lambda: spawned.exists() or failed.exists(), f"the controller's {kind} engine spawned", READY_S)
        info = json.loads(spawned.read_text()) if spawned.exists() else {}
        wait_for(lambda: failed.exists() or http_ok(info["url"] + "/health"), f"the {kind} engine healthy", READY_S)
        if failed.exists():
            raise RuntimeError(f"the {kind} engine did not start: {failed.read_text()}")
        yield LentProc(f"vllm-cpu-{kind}", Path(info["log"])), info["url"]
    finally:
        (shared / f"{kind}.stop").touch()
        wait_for(lambda: (shared / f"{kind}.stopped").exists(), f"the {kind} engine stopped", 60)


def take(kind: str):
    """A fixture's engine: the one started ahead (here, or by the controller of a run with workers),
    or one started now. Yields (process, base URL) once it is healthy and stops it when the fixture ends."""
    lent = _lent(kind)
    if lent is not None:
        yield from _take_lent(kind, lent)
        return
    engine = _AHEAD.get(kind)
    if engine is None or engine.taken:
        engine = Engine(kind)
        engine.spawn(nice=False)
    engine.taken = True
    try:
        yield engine.ready()
    finally:
        engine.stop()


def stop_all() -> None:
    """The session's end: any engine started ahead that no fixture took, and the adapter's folder."""
    _STOPPING.set()
    for engine in _AHEAD.values():
        if not engine.taken:
            engine.stop()
    for folder in _FOLDER:
        shutil.rmtree(folder, ignore_errors=True)
