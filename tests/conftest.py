"""Shared fixtures: real tokenizers, and real processes (simulator, filter, Envoy) on loopback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from derender.ops import assets  # noqa: E402

import real_engines  # noqa: E402
import stack  # noqa: E402
import threadsafe_logging  # noqa: E402
from stack import Redis, Stack  # noqa: E402

threadsafe_logging.install()


# -- test workers (``pytest -n N``, pytest-xdist; ``make test`` runs the suite on two). The controller
# runs no test; each worker runs whole files (``--dist loadfile``: a file's fixtures stay in one
# process). Each process draws its ports from a range of its own (``DERENDER_PORT_RANGE``, which the
# programs it starts inherit): two workers drawing from one range could both start a program on the
# same port. The real vLLM engines are the controller's (``real_engines``), lent to the worker that
# runs their file through a folder they share.
def _workers(config) -> int:
    """How many workers the controller starts (xdist's ``-n``, capped by ``--maxprocesses``: one
    ``--tx`` each); 0 in one process."""
    return len(getattr(config.option, "tx", None) or [])


def _port_range(config, index: int) -> str:
    """Slice ``index`` of the ports (0: the controller's, 1...: the workers')."""
    low, high = config.derender_ports
    size = (high - low) // (_workers(config) + 1)
    return f"{low + index * size}-{low + (index + 1) * size}"


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a worker
        os.environ["DERENDER_PORT_RANGE"] = workerinput["derender_port_range"]
        real_engines.share(workerinput["derender_share"])
    elif _workers(config):  # the controller
        import tempfile

        from derender.ops import children

        config.derender_share = tempfile.mkdtemp(prefix="derender-engines-")
        config.derender_ports = children.port_range() or (10000, 32768)
        os.environ["DERENDER_PORT_RANGE"] = _port_range(config, 0)
        real_engines.share(config.derender_share)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    config = node.config
    index = int(node.gateway.id.removeprefix("gw"))
    node.workerinput["derender_port_range"] = _port_range(config, index + 1)
    node.workerinput["derender_share"] = config.derender_share


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The controller: a worker has collected the suite; the real engines start now, if it has their file."""
    if len(ids) > 300:
        real_engines.prestart(real_engines.kinds_of(ids))


# -- the fork server of ``derender`` processes (``tests/forkserver.py``). For the suite (or most of it)
# its imports start at once, while the first tests run; a few files (``make check``'s, one file alone)
# start it with their first ``derender`` process, if they have one. Each worker has its own.
def pytest_collection_finish(session):
    if len(session.items) > 300:  # a suite run: what is slow to start, started now
        stack.start_forkserver()
        worker = hasattr(session.config, "workerinput")  # with workers, the controller starts the engines
        if not worker:
            real_engines.prestart(real_engines.kinds_of(str(item.path) for item in session.items))


def pytest_sessionfinish(session, exitstatus):
    real_engines.stop_all()
    if stack.FORKS is not None:
        stack.FORKS.stop()
    share = getattr(session.config, "derender_share", None)
    if share:
        import shutil

        shutil.rmtree(share, ignore_errors=True)

# -- hypothesis ------------------------------------------------------------------------------------
# One profile wherever the suite runs. Hypothesis loads a "ci" profile of its own when it sees a CI
# variable (CI, GITHUB_ACTIONS, ...): derandomized draws, seeded by each test's source, so CI drew one
# fixed set of examples that no local run ever drew. Here the draws are random, and ``.ci/run`` seeds
# them with its printed seed (``--hypothesis-seed``): a CI failure replays locally with that seed.
from hypothesis import settings as hypothesis_settings  # noqa: E402

hypothesis_settings.register_profile("derender", derandomize=False, database=None, deadline=None, print_blob=True)
hypothesis_settings.load_profile("derender")


# -- file order --------------------------------------------------------------------------------------
# ``--shuffle-files SEED`` (CI: a fresh seed each run, printed in the header) runs the test files in an
# order drawn from SEED, each file's tests in their own order: a file that passes only after another one
# fails some run, and the printed seed replays that order (``make test TEST_ARGS="--shuffle-files SEED"``).
def pytest_addoption(parser):
    parser.addoption("--shuffle-files", metavar="SEED", default=None, help="run the test files in an order drawn from SEED")


def pytest_report_header(config):
    seed = config.getoption("--shuffle-files")
    return f"test files shuffled with seed {seed} (--shuffle-files {seed})" if seed is not None else None


def pytest_collection_modifyitems(session, config, items):
    seed = config.getoption("--shuffle-files")
    if seed is None:
        return
    import random

    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(files)
    random.Random(seed).shuffle(order)
    items[:] = [item for name in order for item in files[name]]


@pytest.fixture(scope="session")
def qwen3_dir() -> str:
    return str(assets.fetch("qwen3"))


@pytest.fixture(scope="session")
def deepseek_dir() -> str:
    return str(assets.fetch("deepseek-r1"))


@pytest.fixture(scope="session")
def gptoss_dir() -> str:
    return str(assets.fetch("gpt-oss"))


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{qwen3_dir}/tokenizer.json")


@pytest.fixture(scope="session", params=["qwen3", "deepseek-r1", "gpt-oss"])
def hf_tokenizer(request):
    """Each real tokenizer as vLLM's renderer and detokenizer get it (a transformers fast tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets.fetch(request.param)))


class Script:
    """The simulator's JSONL script: what the "GPU" answers next."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def set(self, *choices: dict) -> None:
        self.path.write_text("".join(json.dumps(c) + "\n" for c in choices))


@pytest.fixture(scope="session")
def script(tmp_path_factory) -> Script:
    return Script(tmp_path_factory.mktemp("sim") / "script.jsonl")


def plain(qwen3_dir: str, script: Script, leg: bool = False) -> Stack:
    """Qwen3 without parsers: Envoy + filter + simulator (script mode), started; ``leg``: the response
    leg in the worker (``serve --response-leg worker``)."""
    return Stack(
        qwen3_dir,
        ["--served-model-name", "qwen3", "--max-model-len", "4096"],
        ["--mode", "script", "--script", str(script.path)],
        leg=leg,
    ).start()


def agent(qwen3_dir: str, tmp_path_factory, leg: bool = False) -> Stack:
    """Qwen3 as agents meet it: thinking (qwen3 parser) and tools (hermes), script mode, started; its
    script is ``.script`` (a ``Script``); ``leg`` as ``plain``'s."""
    script = Script(tmp_path_factory.mktemp("agent-sim") / "script.jsonl")
    s = Stack(
        qwen3_dir,
        ["--served-model-name", "qwen3", "--max-model-len", "4096",
         "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
        ["--mode", "script", "--script", str(script.path)],
        leg=leg,
    ).start()
    s.script = script  # type: ignore[attr-defined]
    return s


@pytest.fixture(scope="session")
def plain_stack(qwen3_dir, script):
    """Qwen3 without parsers: Envoy + filter + simulator (script mode)."""
    s = plain(qwen3_dir, script)
    yield s
    s.stop()


@pytest.fixture()
def sim(plain_stack):
    """Default knobs before and after each test."""
    defaults = dict(mode="script", tokens_per_event=1, delay=0.0, finish_only_tail=False, split_writes=1)
    plain_stack.sim_config(**defaults)
    yield plain_stack
    plain_stack.sim_config(**defaults)


@pytest.fixture()
def client(plain_stack):
    from openai import OpenAI

    return OpenAI(base_url=plain_stack.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def agent_stack(qwen3_dir, tmp_path_factory):
    """Qwen3 as agents meet it (``agent``). Its script is ``agent_stack.script`` (a ``Script``)."""
    s = agent(qwen3_dir, tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture()
def agents(agent_stack):
    """The agent stack with the simulator's default knobs before and after each test."""
    defaults = dict(mode="script", tokens_per_event=1, delay=0.0, finish_only_tail=False, split_writes=1)
    agent_stack.sim_config(**defaults)
    yield agent_stack
    agent_stack.sim_config(**defaults)


@pytest.fixture(scope="session")
def h2_target(qwen3_dir):
    """The filter the HTTP/2 conformance, attack and fuzz tests speak to on its ext_proc port (default
    transport; idle connections closed after 5 s, so that the idle timeout is met too), with the
    simulator behind it and Envoy in front."""
    from stack import start_target

    target = start_target(qwen3_dir, "--ext-proc-idle-timeout", "5")
    yield target
    target.stop()


RELEASE_ABOVE = 1 << 31  # bytes of resident memory past which a test file's end gives memory back


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_file():
    """A test worker runs file after file, and files build vLLM models (hundreds of MB each) that
    their module fixtures drop at the file's end, in reference cycles the collector may not walk
    for a long time; a worker grew to 5 GB that way beside the filters its tests start. Past
    ``RELEASE_ABOVE``, a file's end collects them and hands the freed heap back to the system."""
    yield
    import ctypes
    import gc

    import psutil

    if psutil.Process().memory_info().rss > RELEASE_ABOVE:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on a free loopback port for one test file (no persistence)."""
    server = Redis().start()
    yield server
    server.stop()
