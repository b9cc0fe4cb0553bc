"""The package's layout, as the README draws it.

Rooms are stacked in the order the data flows, each importing only rooms below it (function-level
imports included: a lazy import hides a cycle at load time, not in the design):

    settings.py  <  translate  <  exchange.py  <  ops  <  routing  <  stages  <  endpoints  <  extproc  <  cli.py, options.py, up.py

``sim`` (the producer simulator) stands apart: it imports nothing of the filter. A module past 400
lines says why in its own text. And an endpoint is one module plus one line of the registry. No two
modules import each other, directly or around a circle, inside a room either (imports made only for
the type checker, under ``if TYPE_CHECKING:``, name types and are not counted). And vLLM's non-public
surface (a private name, a running frame, a closure cell) is reached from ``translate/vllm_seams.py`` only.
"""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "filter" / "derender"
ORDER = ["settings", "translate", "exchange", "ops", "routing", "stages", "endpoints", "extproc", "top"]


def room(parts: tuple[str, ...]) -> str:
    """The room of a module, from its path inside the package (``("endpoints", "chat")``)."""
    if not parts or parts[0] in ("cli", "options", "routeflags", "up", "__init__", "__main__"):
        return "top"
    return parts[0]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """The lines of ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imported(path: Path, *, typing_only: bool = True) -> list[tuple[int, tuple[str, ...]]]:
    """Every ``derender`` module (as its parts inside the package) that ``path`` imports, with the line;
    ``typing_only=False`` leaves out what ``if TYPE_CHECKING:`` imports."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found = []
    tree = ast.parse(path.read_text())
    skipped = set() if typing_only else _type_checking_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
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


def module_graph() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """Module -> the package's modules it imports (a package is its ``__init__``)."""
    mods = {}
    for path in modules():
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        mods[parts[:-1] if parts[-1] == "__init__" else parts] = path
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in mods}
    for name, path in mods.items():
        for _, target in imported(path, typing_only=False):
            while target and target not in mods:  # ``from .m import f``: the module m
                target = target[:-1]
            if target and target != name and target != name[: len(target)]:  # not its own package
                graph[name].add(target)
    return graph


def circles(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected parts of more than one module (Tarjan)."""
    index: dict[tuple[str, ...], int] = {}
    low: dict[tuple[str, ...], int] = {}
    stack: list[tuple[str, ...]] = []
    found: list[list[str]] = []

    def visit(v: tuple[str, ...]) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(".".join(w))
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    found = circles(module_graph())
    assert not found, "modules importing each other around a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_an_import_circle():
    """The check above can fail: two modules importing each other (one lazily) are a circle, and an import
    under ``if TYPE_CHECKING:`` is not counted."""
    graph = module_graph()
    assert not circles(graph)
    graph[("translate", "errors")].add(("translate", "stream"))  # stream imports errors already
    found = circles(graph)
    assert len(found) == 1 and {"translate.errors", "translate.stream"} <= set(found[0])
    probe = PACKAGE / "translate" / "_layout_probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import stream\ndef f():\n    from . import errors\n")
    try:
        assert imported(probe, typing_only=False) == [(5, ("translate", "errors"))]
        assert imported(probe) == [(3, ("translate", "stream")), (5, ("translate", "errors"))]
    finally:
        probe.unlink()


FRAMES = {"ag_frame", "cr_frame", "gi_frame", "f_locals", "f_back", "f_globals", "cell_contents", "__closure__"}
# Private names of the filter's own objects (or the standard library's) reached from outside them.
OWN_PRIVATE = {
    ("cli.py", "atexit._run_exitfuncs"),
    ("cli.py", "os._exit"),
    ("extproc/workers.py", "os._exit"),
    ("endpoints/responses/store.py", "self.responses._call"),  # its own RedisMapping
}


def reaches_past_vllm(path: Path) -> list[str]:
    """Where ``path`` reads a private name of another object, a frame or a closure cell, or imports a
    private name of vLLM's."""
    rel = path.relative_to(PACKAGE).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found += [f"{rel}:{node.lineno}: imports {a.name}" for a in node.names if a.name.startswith("_")]
        if not isinstance(node, ast.Attribute):
            continue
        text = ast.unparse(node)
        if node.attr in FRAMES or node.attr == "_getframe":
            found.append(f"{rel}:{node.lineno}: {text}")
        elif node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if (rel, text) not in OWN_PRIVATE:
                found.append(f"{rel}:{node.lineno}: {text}")
    return found


def test_vllm_private_surface_only_through_its_seams():
    """vLLM's private names, running frames and closure cells are reached in ``translate/vllm_seams.py``
    only (each seam there named, dated and checked: ``tests/test_vllm_seams.py``). The HTTP/2 server and
    the simulator reach into their own objects, and vLLM nowhere."""
    found = []
    for path in modules():
        parts = path.relative_to(PACKAGE).parts
        if parts[-1] == "vllm_seams.py" or parts[0] == "sim" or parts[:2] == ("extproc", "http2"):
            continue
        found += reaches_past_vllm(path)
    assert not found, "vLLM's non-public surface outside translate/vllm_seams.py:\n" + "\n".join(found)


def test_the_seam_checker_sees_a_frame_read_and_a_private_call():
    probe = PACKAGE / "translate" / "_layout_probe.py"
    probe.write_text(
        "from vllm.x import _Hidden\n"
        "def f(gen, serving):\n"
        "    serving._make_parser(1)\n"
        "    self._mine = 1\n"
        "    return gen.ag_frame.f_locals\n"
    )
    try:
        found = sorted(line.split(": ", 1)[1] for line in reaches_past_vllm(probe))
        assert found == ["gen.ag_frame", "gen.ag_frame.f_locals", "imports _Hidden", "serving._make_parser"]
    finally:
        probe.unlink()


def test_a_long_module_says_why():
    silent = []
    for path in modules():
        text = path.read_text()
        if text.count("\n") > 400 and "longer than 400 lines" not in text.lower():
            silent.append(f"{path.relative_to(PACKAGE)}: {text.count(chr(10))} lines")
    assert not silent, "modules past 400 lines without a reason written in them:\n" + "\n".join(silent)


def echo_exchange(model, producer, x_request_id):
    """A toy endpoint: answers the body's ``say`` at once, never reaching a producer."""
    from derender.exchange import Answered, Reply

    class EchoExchange(Answered):
        async def request_body(self, body: bytes):
            return Reply(200, json.dumps({"said": json.loads(body)["say"], "model": model.name}).encode())

    return EchoExchange()


def test_an_endpoint_is_one_module_and_one_registry_line(qwen3_dir, monkeypatch):
    from derender.endpoints import registry
    from derender.endpoints.router import Backend, Router
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
    assert asyncio.run(ask("/v1/echo/later")).status == 404

    async def under(model, method: str, rest: str) -> Reply:  # the paths below it
        return Reply(200, json.dumps({"under": rest, "method": method, "model": model.name}).encode())

    def in_tier(tier, producer, x_request_id):  # what render-tier mode makes of it
        return echo_exchange(SimpleNamespace(name=f"tier at {tier.url}"), producer, x_request_id)

    echo = Endpoint("/v1/echo", echo_exchange, tier=in_tier, under=under)
    monkeypatch.setitem(registry.ENDPOINTS, "/v1/echo", echo)  # the one line
    reply = asyncio.run(ask("/v1/echo"))
    assert (reply.status, json.loads(reply.body)) == (200, {"said": "hi", "model": "qwen3"})
    reply = asyncio.run(ask("/v1/echo/later"))
    assert json.loads(reply.body) == {"under": "later", "method": "POST", "model": "qwen3"}
    # The same registration in render-tier mode: its tier exchange, no model loaded.
    router = Router(Backend(["qwen3"], Producer("http://127.0.0.1:9"), render_url="http://127.0.0.1:9/render"))
    reply = asyncio.run(ask("/v1/echo"))
    assert (reply.status, json.loads(reply.body)) == (200, {"said": "hi", "model": "tier at http://127.0.0.1:9/render"})
    monkeypatch.setitem(registry.ENDPOINTS, "/v1/echo", Endpoint("/v1/echo", echo_exchange, not_in_tier="not here"))
    reply = asyncio.run(ask("/v1/echo"))
    assert reply.status == 501 and json.loads(reply.body)["error"]["message"] == "not here"


def test_a_stage_is_one_module_and_one_line_where_the_pipeline_is_composed(qwen3_dir, monkeypatch):
    """A toy stage as the next issues' stages plug in (flow control: it may hold or refuse a rendered
    request; KV-event routing and the prefill handoff: they read the rendered prompt): its module (the
    class below) and its line in ``registry.stages``. It reads typed values only (the context, the
    exchange's report, the rewrite) and sees every point of a request, in order."""
    from derender.endpoints import registry
    from derender.endpoints.router import Router
    from derender.exchange import Reply, ResponseStart
    from derender.routing.producer import Producer
    from derender.stages import Stage
    from derender.translate.model import Model, ModelSpec

    seen: list[tuple] = []

    class Gate(Stage):  # stages/gate.py
        def __init__(self, room: int) -> None:
            self.room = room

        def begin(self, ctx):
            seen.append(("begin", ctx.endpoint.path, ctx.x_request_id))

        async def admit(self, ctx, rewrite):
            seen.append(("admit", ctx.report.asked.model, ctx.report.asked.stream, len(rewrite.prompt_ids)))
            if self.room == 0:
                ctx.report.client_status = 429
                return Reply(429, b'{"error": "full"}', headers={"retry-after": "1"})
            self.room -= 1
            rewrite.set_headers["x-gate"] = "passed"
            return None

        def started(self, ctx, start: ResponseStart) -> None:
            seen.append(("started", ctx.report.status, ctx.report.upstream))

        def end(self, ctx):
            seen.append(("end", ctx.report.client_status, ctx.report.complete))

    composed = registry.stages
    monkeypatch.setattr(registry, "stages", lambda budgets: [Gate(1), *composed(budgets)])  # the one line
    model = Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3",)))
    router = Router(model, Producer("http://127.0.0.1:9"))
    body = json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()

    async def one(headers: dict[str, str]):
        exchange = await router.route({":method": "POST", ":path": "/v1/chat/completions", **headers}, False)
        result = await exchange.request_body(body)
        if not isinstance(result, Reply):
            exchange.response_headers(503, "127.0.0.1:9")
            await exchange.response_body(b'{"error": {"message": "no"}}')
        exchange.close(True)
        return result

    first = asyncio.run(one({"x-request-id": "a"}))
    assert first.set_headers["x-gate"] == "passed" and first.prompt_ids
    assert [s[0] for s in seen] == ["begin", "admit", "started", "end"]
    assert seen[0] == ("begin", "/v1/chat/completions", "a") and seen[1][1:3] == ("qwen3", True)
    assert seen[2] == ("started", 503, "127.0.0.1:9") and seen[3] == ("end", 503, True)
    seen.clear()
    refused = asyncio.run(one({"x-request-id": "b"}))
    assert isinstance(refused, Reply) and refused.status == 429
    assert [s[0] for s in seen] == ["begin", "admit", "end"] and seen[-1] == ("end", 429, True)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_endpoint_owns_its_error_shape(path):
    from derender.endpoints import registry
    from derender.translate.errors import HTTPError

    anthropic = json.loads(registry.shaped(path + "?beta=true", HTTPError(401, "Unauthorized")).body())
    assert anthropic == {"type": "error", "error": {"type": "authentication_error", "message": "Unauthorized"}}
    openai = json.loads(registry.shaped("/v1/chat/completions", HTTPError(401, "Unauthorized")).body())
    assert openai["error"]["message"] == "Unauthorized" and openai["error"]["code"] == 401
