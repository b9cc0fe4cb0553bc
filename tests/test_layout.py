"""The package's layout, as the README draws it.

Rooms are stacked in the order the data flows, each importing only rooms below it (function-level
imports included: a lazy import hides a cycle at load time, not in the design):

    translate  <  exchange.py  <  ops  <  routing  <  endpoints  <  extproc  <  cli.py, options.py, up.py

``sim`` (the producer simulator) stands apart: it imports nothing of the filter. A module past 400
lines says why in its own text. And an endpoint is one module plus one line of the registry.
"""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "filter" / "derender"
ORDER = ["translate", "exchange", "ops", "routing", "endpoints", "extproc", "top"]


def room(parts: tuple[str, ...]) -> str:
    """The room of a module, from its path inside the package (``("endpoints", "chat")``)."""
    if not parts or parts[0] in ("cli", "options", "up", "__init__", "__main__"):
        return "top"
    return parts[0]


def imported(path: Path) -> list[tuple[int, tuple[str, ...]]]:
    """Every ``derender`` module (as its parts inside the package) that ``path`` imports, with the line."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, tuple(a.name.split(".")[1:])) for a in node.names if a.name.split(".")[0] == "derender"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = base + tuple(node.module.split(".") if node.module else ())
            elif node.module and node.module.split(".")[0] == "derender":
                target = tuple(node.module.split(".")[1:])
            else:
                continue
            if node.module is None or not target:  # from . import a, b: the names are modules
                found += [(node.lineno, target + (a.name,)) for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_rooms_import_only_the_rooms_below_them():
    wrong = []
    for path in modules():
        source = room(path.relative_to(PACKAGE).with_suffix("").parts)
        for line, target in imported(path):
            to = room(target)
            if to == source:
                continue
            if source == "sim" or to == "sim":
                if source != "top":  # only the command line starts the simulator
                    wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {'.'.join(target)}")
                continue
            if ORDER.index(to) > ORDER.index(source):
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} ({source}) imports {'.'.join(target)} ({to})")
    assert not wrong, "imports against the data flow:\n" + "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check above can fail: a lazy import of an upper room inside a function is found."""
    probe = PACKAGE / "translate" / "_layout_probe.py"
    probe.write_text("def f():\n    from ..endpoints import chat\n    return chat\n")
    try:
        assert imported(probe) == [(2, ("endpoints",))]
        assert ORDER.index(room(("endpoints",))) > ORDER.index(room(("translate", "_layout_probe")))
    finally:
        probe.unlink()


def test_a_long_module_says_why():
    silent = []
    for path in modules():
        text = path.read_text()
        if text.count("\n") > 400 and "longer than 400 lines" not in text.lower():
            silent.append(f"{path.relative_to(PACKAGE)}: {text.count(chr(10))} lines")
    assert not silent, "modules past 400 lines without a reason written in them:\n" + "\n".join(silent)


class EchoExchange:
    """A toy endpoint: answers the body's ``say`` at once, never reaching a producer."""

    stream = None

    def __init__(self, model, producer, x_request_id) -> None:
        self.model = model

    async def request_body(self, body: bytes):
        from derender.exchange import Reply

        return Reply(200, json.dumps({"said": json.loads(body)["say"], "model": self.model.name}).encode())

    def close(self, complete: bool) -> None:
        pass


def test_an_endpoint_is_one_module_and_one_registry_line(qwen3_dir, monkeypatch):
    from derender.endpoints import registry
    from derender.endpoints.router import Router
    from derender.exchange import Endpoint, Reply
    from derender.routing.producer import Producer
    from derender.translate.model import Model, ModelSpec

    model = Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3",)))
    router = Router(model, Producer("http://127.0.0.1:9"))

    async def ask(path: str) -> Reply:
        routed = await router.route({":method": "POST", ":path": path}, False)
        if isinstance(routed, Reply):
            return routed
        return await routed.request_body(b'{"say": "hi"}')

    assert asyncio.run(ask("/v1/echo")).status == 404  # not registered: not served
    monkeypatch.setitem(registry.ENDPOINTS, "/v1/echo", Endpoint("/v1/echo", EchoExchange))  # the one line
    reply = asyncio.run(ask("/v1/echo"))
    assert (reply.status, json.loads(reply.body)) == (200, {"said": "hi", "model": "qwen3"})


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_endpoint_owns_its_error_shape(path):
    from derender.endpoints import registry
    from derender.translate.errors import HTTPError

    anthropic = json.loads(registry.shaped(path + "?beta=true", HTTPError(401, "Unauthorized")).body())
    assert anthropic == {"type": "error", "error": {"type": "authentication_error", "message": "Unauthorized"}}
    openai = json.loads(registry.shaped("/v1/chat/completions", HTTPError(401, "Unauthorized")).body())
    assert openai["error"]["message"] == "Unauthorized" and openai["error"]["code"] == 401
