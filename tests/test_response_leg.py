"""The response leg in the worker (``serve --response-leg worker``, ``derender.extproc.leg``).

End to end, the chat, Messages and Responses tests of ``test_chat_e2e``, ``test_messages`` and
``test_responses`` that run on the shared stacks run again here, through real Envoy with
``envoy_config.response_leg``'s config: the same simulator, the same expectations (the tokenizer's
text, vLLM's errors, the producer told to stop when the client goes). Envoy's own counters show the
answers took the leg and never Envoy's producer cluster.

The leg listener is attacked directly, in this process: a real ``Router`` of qwen3 renders the request
a token is handed for, and the simulator is the producer behind it.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import test_chat_e2e
import test_messages
import test_responses
from leg_stacks import agent_stack, borrow, plain_stack  # noqa: F401  (the shared stacks, with the leg)
from stack import envoy_counter, free_port, http_get, start_envoy, start_filter, start_sim, until, wait_for

from derender.extproc import leg as leg_package
from derender.extproc.leg import front
from derender.ops import envoy_config

SHARED_STACKS = {"sim", "client", "agents", "plain_stack", "agent_stack"}
for _module, _prefix in ((test_chat_e2e, "chat_"), (test_messages, "messages_"), (test_responses, "responses_")):
    borrow(_module, globals(), SHARED_STACKS, _prefix)


def test_the_header_names_are_the_filters():
    assert (envoy_config.LEG_HEADER, envoy_config.WORKER_HEADER) == (leg_package.LEG_HEADER, leg_package.WORKER_HEADER)


def test_answers_come_through_the_leg_and_never_envoys_producer_cluster(sim, client, script, qwen3_tokenizer):
    admin = sim.proc("envoy").admin_port
    counters = ("cluster.derender_leg.upstream_rq_total", "cluster.producer.upstream_rq_total")
    before = [envoy_counter(admin, c) for c in counters]
    ids = test_chat_e2e.encode(qwen3_tokenizer, "through the worker") + [test_chat_e2e.IM_END]
    script.set({"index": 0, "token_ids": ids})
    text, _ = test_chat_e2e.stream_text(client)
    assert text == qwen3_tokenizer.decode(ids[:-1])
    answer = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == text
    after = [envoy_counter(admin, c) for c in counters]
    assert (after[0] - before[0], after[1] - before[1]) == (2, 0)


def test_a_clients_own_leg_headers_are_stripped(sim, script, qwen3_tokenizer):
    """A client naming a worker address (Envoy would connect there) and a token: the filter's own replace them."""
    ids = test_chat_e2e.encode(qwen3_tokenizer, "steered nowhere") + [test_chat_e2e.IM_END]
    script.set({"index": 0, "token_ids": ids})
    forged = {"x-derender-worker": "127.0.0.1:9", "x-derender-leg": "forged"}
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(sim.base_url + "/chat/completions", json=body, headers=forged, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == qwen3_tokenizer.decode(ids[:-1])
    seen = {k.lower() for k in sim.sim_headers()[-1]}
    assert "x-derender-leg" not in seen and "x-derender-worker" not in seen, seen  # the producer gets neither


@pytest.mark.parametrize("stream", [False, True])
def test_producer_unreachable_is_a_503_in_each_clients_shape(qwen3_dir, stream):
    dead = f"http://127.0.0.1:{free_port()}"
    flt, port = start_filter(["--model", qwen3_dir, "--served-model-name", "qwen3", "--response-leg", "worker"], dead)
    try:
        envoy, base = start_envoy(port, dead, edit=envoy_config.response_leg)
        try:
            chat = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
            assert "connection failure" in r.json()["error"]["message"]
            messages = {"model": "qwen3", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            r = httpx.post(base + "/v1/messages", json=messages, timeout=30)
            assert r.status_code == 503 and r.json()["type"] == "error", r.text
        finally:
            envoy.stop()
    finally:
        flt.stop()


def test_serve_refuses_what_the_leg_cannot_do_yet(qwen3_dir):
    import subprocess
    import sys

    for flags, says in (
        (["--producer", "http://127.0.0.1:1,http://127.0.0.1:2"], "several --producer URLs"),
        (["--routing", "prefix"], "--routing prefix"),
        (["--prefill", "http://127.0.0.1:3"], "--prefill"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "derender.cli", "serve", "--model", qwen3_dir, "--response-leg", "worker", *flags],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode != 0 and says in run.stderr, run.stderr[-2000:]


# -- the leg listener, attacked directly ---------------------------------------------------------
@pytest.fixture(scope="module")
def producer(qwen3_dir):
    sim, url = start_sim(qwen3_dir)
    yield url
    sim.stop()


@pytest.fixture(scope="module")
def model(qwen3_dir):
    from derender.translate.model import Model, ModelSpec

    return Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3",), max_model_len=4096))


class Listener:
    """A ``LegServer`` on loopback with a real ``Router`` of qwen3 producing at ``producer``."""

    def __init__(self, model, producer: str) -> None:
        from derender.endpoints.router import Router
        from derender.routing.producer import Producer

        self.producer = Producer(producer)
        self.router = Router(model, self.producer)
        self.defences: list[str] = []
        self.server = front.LegServer(producer, on_defence=self.defences.append)

    async def __aenter__(self) -> Listener:
        await self.server.start()
        host, _, port = self.server.address.rpartition(":")
        self.host, self.port = host, int(port)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.close()
        await self.producer.close()

    async def park(self, stream: bool = True, text: str = "hi") -> tuple[str, object]:
        """A rendered chat request handed to the leg as ext_proc hands it (its producer request goes out
        now): (its token, its exchange)."""
        routed = await self.router.route({":method": "POST", ":path": "/v1/chat/completions"}, False)
        body = {"model": "qwen3", "messages": [{"role": "user", "content": text}], "stream": stream, "max_tokens": 8}
        rewrite = await routed.request_body(json.dumps(body).encode())
        token = self.server.hand(routed, rewrite)
        assert token is not None
        return token, routed

    async def send(self, data: bytes, wait: float = 10.0) -> bytes:
        """``data`` on a new connection; everything read until the listener closes it (or ``wait`` s)."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(data)
        got = b""
        deadline = time.monotonic() + wait
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic())):
                got += chunk
        except (asyncio.TimeoutError, ConnectionResetError):
            pass
        writer.close()
        return got


def request(token: str | None = None, method: bytes = b"POST", extra: bytes = b"", body: bytes = b"") -> bytes:
    head = method + b" /inference/v1/generate HTTP/1.1\r\nhost: leg\r\n"
    if token is not None:
        head += b"x-derender-leg: " + token.encode() + b"\r\n"
    return head + extra + b"content-length: %d\r\n\r\n" % len(body) + body


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def error_of(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


CASES = {
    "no token": (lambda t: request(None), 503, "leg_token"),
    "a forged token": (lambda t: request("not-one-handed-out"), 503, "leg_token"),
    "another method": (lambda t: request(t, method=b"GET"), 405, "leg_method"),
    "a head too large": (lambda t: request(t, extra=b"x-big: " + b"a" * (front.MAX_HEAD + 1) + b"\r\n"), 431, "leg_headers"),
    "too many header lines": (lambda t: request(t, extra=b"x-n: 1\r\n" * (front.MAX_HEADERS + 1)), 431, "leg_headers"),
    "not HTTP": (lambda t: b"\x16\x03\x01\x02\x00 hello\r\n\r\n", 400, "leg_malformed"),
    "an upgrade": (lambda t: request(t, extra=b"connection: upgrade\r\nupgrade: h2c\r\n"), 400, "leg_malformed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_leg_listener_refuses_what_envoy_never_sends(model, producer, case):
    """Each answered in OpenAI's shape and the connection closed; the defence counted; no producer
    request comes of it (the parked request's own went out when it was handed over)."""
    make, status, defence = CASES[case]

    def received() -> int:
        return json.loads(http_get(producer + "/sim/stats")[1])["received"]

    async def run() -> None:
        async with Listener(model, producer) as listener:
            before = received()
            token, _ = await listener.park()
            await until(lambda: received() == before + 1, "the parked request's producer request")
            answer = await listener.send(make(token))
            assert status_of(answer) == status, answer[:300]
            assert error_of(answer)["code"] == status
            assert listener.defences == [defence]
            await asyncio.sleep(0.2)
            assert received() == before + 1

    asyncio.run(run())


def test_a_token_serves_once(model, producer):
    async def run() -> None:
        async with Listener(model, producer) as listener:
            token, _ = await listener.park(stream=True)
            answer = await listener.send(request(token))
            assert status_of(answer) == 200 and b"transfer-encoding: chunked" in answer
            assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), answer[-200:]
            again = await listener.send(request(token))
            assert status_of(again) == 503 and listener.defences == ["leg_token"]
            assert not listener.server.legs and not len(listener.server.parked)

    asyncio.run(run())


def test_a_body_over_the_limit_is_refused_and_its_producer_request_aborted(model, producer):
    """A token with a body (Envoy sends none: the rendered request went to the producer from the worker):
    413, and the exchange closed as a request whose client left, so its producer request is aborted,
    as the coupled server aborts it."""

    async def run() -> str:
        async with Listener(model, producer) as listener:
            token, exchange = await listener.park()
            answer = await listener.send(request(token, body=b"x" * (front.MAX_BODY + 1)))
            assert status_of(answer) == 413 and listener.defences == ["leg_body"]
            return exchange.ctx.exchange.request_id

    request_id = asyncio.run(run())
    wait_for(lambda: any(request_id in a for a in json.loads(http_get(producer + "/sim/aborted")[1])),
             "the producer request aborted", timeout=10)  # fmt: skip


def test_slow_idle_and_surplus_connections_are_closed(model, producer, monkeypatch):
    monkeypatch.setattr(front, "FIRST_REQUEST", 0.3)
    monkeypatch.setattr(front, "HEAD_TIMEOUT", 0.3)
    monkeypatch.setattr(front, "IDLE", 0.3)
    monkeypatch.setattr(front, "MAX_CONNECTIONS", 3)

    async def closed_after(listener: Listener, data: bytes) -> float:
        started = time.monotonic()
        answer = await listener.send(data, wait=5)
        assert answer == b""  # closed without a word
        return time.monotonic() - started

    async def run() -> None:
        async with Listener(model, producer) as listener:
            assert await closed_after(listener, b"") < 2  # connected, sent nothing
            assert await closed_after(listener, b"POST /inference/v1/generate HTTP/1.1\r\nhost: x\r\n") < 2  # a slow head
            assert listener.defences == ["leg_first_request", "leg_slow_request"]
            # Kept alive after a whole answer, then idle: closed too.
            token, _ = await listener.park(stream=False)
            reader, writer = await asyncio.open_connection(listener.host, listener.port)
            writer.write(request(token))
            got = b""
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                got += chunk
            assert status_of(got) == 200 and json.loads(got.split(b"\r\n\r\n", 1)[1])["object"] == "chat.completion"
            assert listener.defences[-1] == "leg_idle"
            writer.close()
            # Past MAX_CONNECTIONS, a new connection is closed at once while the others stay.
            held = [await asyncio.open_connection(listener.host, listener.port) for _ in range(3)]
            await asyncio.sleep(0.05)
            surplus_reader, surplus_writer = await asyncio.open_connection(listener.host, listener.port)
            assert await asyncio.wait_for(surplus_reader.read(), 2) == b""
            assert "leg_connections" in listener.defences
            for _, w in held:
                w.close()
            surplus_writer.close()

    asyncio.run(run())


def test_a_parked_request_never_taken_is_dropped_and_its_producer_request_aborted(model, producer, monkeypatch):
    async def run() -> str:
        async with Listener(model, producer) as listener:
            listener.server.parked.ttl = 0.2
            _, exchange = await listener.park()
            await asyncio.sleep(0.5)
            assert not len(listener.server.parked)
            return exchange.ctx.exchange.request_id

    request_id = asyncio.run(run())
    wait_for(lambda: any(request_id in a for a in json.loads(http_get(producer + "/sim/aborted")[1])),
             "the producer request aborted", timeout=10)  # fmt: skip


def test_ext_proc_hands_the_request_to_the_leg_and_refuses_past_the_bound(model, producer):
    """The ext_proc side (``ExternalProcessor.serve_stream`` fed Envoy's messages): the rewrite names
    this worker's leg and a token, sends no body, and the stream ends there; with ``Parked.most``
    requests waiting, the next is refused with a 503 in the client's shape, before any producer."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from grpc.aio import EOF

    from derender.extproc.server import ExternalProcessor

    def messages() -> list:
        headers = pb.HttpHeaders()
        for key, value in {":method": "POST", ":path": "/v1/chat/completions", "x-derender-leg": "forged"}.items():
            headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
        body = json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        return [pb.ProcessingRequest(request_headers=headers),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)), EOF]  # fmt: skip

    async def stream(processor) -> list:
        inbox, replies = messages(), []

        async def read():
            return inbox.pop(0)

        async def write(reply) -> None:
            replies.append(reply)

        await processor.serve_stream(read, write, encoded=False)
        return replies

    async def run() -> None:
        async with Listener(model, producer) as listener:
            processor = ExternalProcessor(listener.router, leg=listener.server)
            first, rewrite = await stream(processor)
            assert "x-derender-leg" in first.request_headers.response.header_mutation.remove_headers  # the client's
            common = rewrite.request_body.response
            sets = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
            assert sets["x-derender-worker"] == listener.server.address and sets["content-length"] == "0"
            assert common.body_mutation.clear_body and common.clear_route_cache
            leg = listener.server.parked.take(sets["x-derender-leg"])
            assert leg is not None
            leg.client_gone()
            listener.server.parked.most = 0
            _, refused = await stream(processor)
            assert refused.immediate_response.status.code == 503
            assert json.loads(refused.immediate_response.body)["error"]["code"] == 503

    asyncio.run(run())


def test_sigterm_lets_the_answers_on_the_leg_finish(plain_stack, qwen3_dir, sim, script, qwen3_tokenizer):  # noqa: F811
    """``test_reliability``'s drain with the response leg: a stream in flight on the worker's leg (its
    ext_proc stream long over) runs to [DONE] after SIGTERM, new requests are refused, and the filter
    exits once it is done."""
    from test_reliability import drains

    drains(plain_stack, qwen3_dir, sim, script, qwen3_tokenizer, ("--response-leg", "worker"), envoy_config.response_leg)
