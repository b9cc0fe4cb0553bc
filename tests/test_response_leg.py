"""The response leg in the worker (``serve --response-leg worker``, ``derender.extproc.leg``).

End to end, the chat, Messages and Responses tests of ``test_chat_e2e``, ``test_messages`` and
``test_responses`` that run on the shared stacks run again here, through real Envoy with
``envoy_config.response_leg``'s config: the same simulator, the same expectations (the tokenizer's
text, vLLM's errors, the producer told to stop when the client goes). Envoy's own counters show the
answers took the leg and never Envoy's producer cluster.

The leg listener (HTTP/2, the filter's own frame layer in plain HTTP mode) is attacked directly, in this
process, by raw HTTP/2 peers (``h2peer``): a real ``Router`` of qwen3 renders the request a token is
handed for, and the simulator is the producer behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import httpx
import pytest
import test_chat_e2e
import test_messages
import test_responses
from h2peer import Peer
from leg_stacks import agent_stack, borrow, plain_stack  # noqa: F401  (the shared stacks, with the leg)
from stack import envoy_counter, free_port, http_get, start_envoy, start_filter, start_sim, wait_for

from derender.extproc import leg as leg_package
from derender.extproc.http2 import wire
from derender.extproc.http2.wire import frame
from derender.extproc.leg import front
from derender.ops import envoy_config

SHARED_STACKS = {"sim", "client", "agents", "plain_stack", "agent_stack"}
for _module, _prefix in ((test_chat_e2e, "chat_"), (test_messages, "messages_"), (test_responses, "responses_")):
    borrow(_module, globals(), SHARED_STACKS, _prefix)


def test_the_header_names_are_the_filters():
    assert (envoy_config.LEG_HEADER, envoy_config.WORKER_HEADER) == (leg_package.LEG_HEADER, leg_package.WORKER_HEADER)
    assert envoy_config.LEG_CAPABLE == leg_package.CAPABLE


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


def test_a_replica_that_refuses_connections_is_passed_over(qwen3_dir):
    """``--producer`` with a dead replica first and a live one, named by its host name (the system's
    resolver gives its address): every request is answered by the live one (a connect failure goes to
    another replica, as Envoy's ``retry_on: connect-failure``), and each reached it once (nothing reached
    a producer twice)."""
    sim, live = start_sim(qwen3_dir)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        flt, port = start_filter(["--model", qwen3_dir, "--served-model-name", "qwen3", "--response-leg", "worker"],
                                 f"{dead},{live.replace('127.0.0.1', 'localhost')}")  # fmt: skip
        try:
            envoy, base = start_envoy(port, live, edit=envoy_config.response_leg)
            try:
                for i in range(6):
                    chat = {"model": "qwen3", "messages": [{"role": "user", "content": f"hi {i}"}], "stream": i % 2 == 1}
                    r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=30)
                    assert r.status_code == 200, r.text
                    assert ("data: [DONE]" in r.text) if i % 2 else r.json()["choices"][0]["message"]["content"]
                assert json.loads(http_get(live + "/sim/stats")[1])["received"] == 6
            finally:
                envoy.stop()
        finally:
            flt.stop()
    finally:
        sim.stop()


def test_replicas_balance_by_least_request_and_pass_over_one_that_refused():
    """``wire.Replicas`` as Envoy's least-request cluster with its connect-failure retry: the replica with
    the fewest requests in flight; one that refused a connection is passed over while another is up, for
    ``DOWN`` seconds; a request never goes to a replica it tried; with one replica left, that one."""
    from derender.extproc.leg.wire import Replicas

    now = [0.0]
    replicas = Replicas(["http://a:1", "http://b:2", "http://c:3"], clock=lambda: now[0])
    a, b, c = replicas.targets
    replicas.started(a)
    replicas.started(b)
    assert {replicas.pick() for _ in range(50)} == {c}
    replicas.started(c)
    replicas.started(c)
    assert {replicas.pick() for _ in range(50)} == {a, b}
    replicas.finished(a)
    assert replicas.pick() is a
    replicas.failed(a)
    assert {replicas.pick() for _ in range(50)} == {b}  # a is passed over while b and c are up
    assert replicas.pick([b]) is c and replicas.pick([b, c]) is a and replicas.pick([a, b, c]) is None
    now[0] += Replicas.DOWN
    assert replicas.pick() is a
    single = Replicas(["http://a:1"], clock=lambda: now[0])
    single.failed(single.targets[0])
    assert single.pick() is single.targets[0]  # the only one, down or not


def test_replicas_keep_a_key_on_its_replica_within_the_load_bound():
    """With a prefix key: the same replica for the same key in every worker (two ``Replicas`` of the same
    URLs), keys spread over the replicas, and past 1.25x the mean of requests in flight the key's next
    replica in its own order; a replica routing names is found by its address."""
    from derender.extproc.leg.wire import Replicas

    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    one, two = Replicas(urls), Replicas(urls)
    keys = [f"key-{i}" for i in range(30)]
    assert [one.pick(key=k).url for k in keys] == [two.pick(key=k).url for k in keys]
    assert len({one.pick(key=k) for k in keys}) == 3
    home = one.pick(key="hot")
    for _ in range(4):  # 4 in flight on it: the bound for the fifth is 1.25 x 5 / 3, about 2.1
        one.started(home)
    elsewhere = one.pick(key="hot")
    assert elsewhere is not home and elsewhere is one.pick([home], key="hot")
    for _ in range(4):
        one.finished(home)
    assert one.pick(key="hot") is home
    assert one.named("10.0.0.2:8000") is one.targets[1] and one.named("10.0.0.9:8000") is None
    six = Replicas(["http://[::1]:8000", "http://10.0.0.1:8000"])
    assert six.named("[::1]:8000") is six.targets[0] and six.named("::1:8000") is None  # as Envoy writes it


def test_replicas_spread_over_the_addresses_a_name_resolves_to():
    """A producer URL's host name stands for each address it resolves to (Envoy's ``STRICT_DNS``, as
    compose's ``--scale producer=N`` behind one name): each address a replica of its own, by least request
    and in a prefix key's order; looked up again every ``DNS_REFRESH`` seconds, in the background once
    addresses are known; a replica gone from the answer keeps its count until its requests end; a failed
    lookup keeps the addresses it had. The resolver stands in for DNS; the system's own resolves localhost."""
    import asyncio

    from derender.extproc.leg.wire import DNS_REFRESH, Replicas, lookup

    now = [0.0]
    answers = {"producer": ["10.0.0.1", "10.0.0.2", "10.0.0.3"]}
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        if answers.get(host) is None:
            raise OSError(f"{host}: no address")
        return list(answers[host])

    async def scenario() -> None:
        urls = ["http://producer:8000", "http://10.9.9.9:8000"]
        replicas = Replicas(urls, clock=lambda: now[0], resolve=resolve)
        await replicas.refresh()
        assert [t.host for t in replicas.targets] == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.9.9.9"]
        assert {t.authority for t in replicas.targets[:3]} == {"producer:8000"}  # the Host header keeps the name
        assert {t.name for t in replicas.targets[:3]} == {"producer"}  # and a TLS producer's certificate
        for _ in range(4):
            replicas.started(replicas.pick())
        assert sorted(replicas.active.values()) == [1, 1, 1, 1]  # one request each
        twin = Replicas(urls, resolve=resolve)
        await twin.refresh()
        keys = [f"key-{i}" for i in range(40)]
        assert [replicas.pick(key=k).key for k in keys] == [twin.pick(key=k).key for k in keys]
        assert len({twin.pick(key=k).host for k in keys}) == 4  # every address has keys of its own
        await replicas.refresh()
        assert asked == ["producer", "producer"]  # not again before DNS_REFRESH (the twin asked once)
        gone = replicas.targets[0]
        answers["producer"] = ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
        now[0] += DNS_REFRESH
        await replicas.refresh()  # known addresses: the lookup runs in the background
        assert replicas.targets[0] is gone
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [t.host for t in replicas.targets] == ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.9.9.9"]
        assert replicas.active[gone] == 1 and gone not in {replicas.pick() for _ in range(50)}
        replicas.finished(gone)
        answers["producer"] = None
        now[0] += DNS_REFRESH
        await replicas.refresh()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [t.host for t in replicas.targets] == ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.9.9.9"]
        assert gone not in replicas.active  # its requests over and gone from DNS: forgotten
        answers["producer"] = []  # an empty answer is no answer
        now[0] += DNS_REFRESH
        await replicas.refresh()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [t.host for t in replicas.targets] == ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.9.9.9"]
        assert len(asked) == 5
        assert await lookup("localhost", 80) == ["127.0.0.1"]

    asyncio.run(scenario())


def test_leg_host_may_name_a_network():
    """``--leg-host 172.30.90.0/24`` (compose's extproc network): the listener is on this machine's address
    in it, and that is the address Envoy is given; a network this machine has no address in is refused."""
    import asyncio
    import ipaddress
    import socket

    import psutil
    from derender.extproc.leg import front

    async def scenario() -> None:
        server = front.LegServer("http://127.0.0.1:1", "127.0.0.0/8")
        address = await server.start()
        try:
            assert address == f"127.0.0.1:{server.server.port}", address
            reader, writer = await asyncio.open_connection("127.0.0.1", server.server.port)
            writer.close()
        finally:
            await server.close()
        mine = [ipaddress.ip_address(a.address.split("%")[0]) for addresses in psutil.net_if_addrs().values()
                for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]  # fmt: skip
        elsewhere = next(n for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")  # the documentation nets
                         if not any(a in ipaddress.ip_network(n) for a in mine))  # fmt: skip
        with pytest.raises(OSError, match="no address in"):
            await front.LegServer("http://127.0.0.1:1", elsewhere).start()

    asyncio.run(scenario())


def test_the_leg_mode_resolves_auto_and_refuses_worker_where_a_flag_lacks_it():
    """``leg.resolve``, which ``serve`` (``options.settings``) and ``up`` both use."""
    from derender.extproc.leg import resolve, unsupported

    assert resolve("auto", "") == "worker" and resolve("auto", "--prefill") == "envoy"
    assert resolve("worker", "") == "worker" and resolve("envoy", "") == resolve("envoy", "--prefill") == "envoy"
    with pytest.raises(ValueError, match="--response-leg worker does not yet work with --routing kv-events"):
        resolve("worker", unsupported(None, None, "kv-events", None))


def test_serve_refuses_what_the_leg_cannot_do_yet(qwen3_dir):
    import subprocess
    import sys

    for flags, says in (
        (["--render-url", "http://127.0.0.1:4"], "--render-url"),
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

    def __init__(self, model, producer: str, limits=None) -> None:
        from derender.endpoints.router import Router
        from derender.routing.producer import Producer

        self.producer = Producer(producer)
        self.router = Router(model, self.producer)
        self.defences: list[str] = []
        self.server = front.LegServer(producer, on_defence=self.defences.append, limits=limits or front.LIMITS)

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


class Served:
    """A ``Listener`` on an event loop of its own thread, for blocking HTTP/2 peers (``h2peer.Peer``),
    which play Envoy, or an attacker."""

    def __init__(self, model, producer: str, limits=None) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict] = []  # what the loop's callbacks raised: none may
        self.loop.set_exception_handler(lambda loop, context: self.errors.append(context))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.args = model, producer, limits

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> Served:
        self.thread.start()

        async def make() -> Listener:
            return await Listener(*self.args).__aenter__()

        self.listener = self.call(make())
        self.port = self.listener.port
        return self

    def __exit__(self, *exc) -> None:
        self.call(self.listener.__aexit__())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        assert not self.errors, self.errors

    @property
    def defences(self) -> list[str]:
        return self.listener.defences

    def park(self, **kw) -> tuple[str, object]:
        return self.call(self.listener.park(**kw))


def leg_fields(token: str | None, method: str = "POST", extra: list | None = None) -> list[tuple[str, str]]:
    """A leg request's header fields as Envoy sends them."""
    fields = [(":method", method), (":scheme", "http"), (":path", "/v1/chat/completions"), (":authority", "leg")]
    return fields + ([("x-derender-leg", token)] if token is not None else []) + (extra or [])


def ask(peer: Peer, fields: list[tuple[str, str]], body: bytes | None = None) -> tuple[str, bytes, str]:
    """One stream: (its :status or "", its body, "END_STREAM" or the RST_STREAM's error)."""
    sid = peer.stream_id()
    peer.send(peer.headers(sid, fields=fields, end_stream=body is None))
    if body is not None:
        peer.send(frame(wire.DATA, wire.END_STREAM, sid, body))
    return answer(peer, sid)


def answer(peer: Peer, sid: int) -> tuple[str, bytes, str]:
    seen = peer.frames(10, until=lambda f: f.stream == sid and (f.kind == wire.RST_STREAM or f.flags & wire.END_STREAM
                                                                  and f.kind in (wire.DATA, wire.HEADERS)))  # fmt: skip
    mine = [f for f in seen if f.stream == sid]
    assert mine, seen
    status = next((f.field(":status") for f in mine if f.kind == wire.HEADERS), "") or ""
    body = b"".join(f.payload for f in mine if f.kind == wire.DATA)
    end = mine[-1].error if mine[-1].kind == wire.RST_STREAM else "END_STREAM"
    return status, body, end


CASES = {
    "no token": (lambda t: leg_fields(None), "503", "leg_token"),
    "a forged token": (lambda t: leg_fields("not-one-handed-out"), "503", "leg_token"),
    "another method": (lambda t: leg_fields(t, method="GET"), "405", "leg_method"),
    # 4,000 copies of one field: a few KiB of HPACK, past the 128 KiB list decoded (32 bytes a field more).
    "a header list too large": (lambda t: leg_fields(t, extra=[("x-n", "1")] * 4000), "431", "leg_header_list_size"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_leg_listener_refuses_what_envoy_never_sends(model, producer, case):
    """Each answered with its status (in OpenAI's shape where the leg answers; the frame layer's 431 is
    the status alone) and the stream ended, the connection still serving; the defence counted; no
    producer request comes of it (the parked request's own went out when it was handed over)."""
    make, status, defence = CASES[case]

    def received() -> int:
        return json.loads(http_get(producer + "/sim/stats")[1])["received"]

    with Served(model, producer) as served:
        before = received()
        token, _ = served.park()
        wait_for(lambda: received() == before + 1, "the parked request's producer request")
        with Peer.connect(served.port) as peer:
            got, body, end = ask(peer, make(token))
            assert (got, end) == (status, "END_STREAM"), body[:300]
            if status != "431":
                assert json.loads(body)["error"]["code"] == int(status)
            assert served.defences[-1] == defence, served.defences
            assert peer.alive()
        time.sleep(0.2)
        assert received() == before + 1


def test_a_token_serves_once_and_streams_share_a_connection(model, producer):
    """Three parked requests brought on one connection, as Envoy's pool brings them: each answered
    whole (SSE to [DONE], the stream's end), their DATA interleaved as the producer's events come; a
    token brought again is refused."""
    with Served(model, producer) as served:
        tokens = [served.park(stream=True, text=f"hi {i}")[0] for i in range(3)]
        with Peer.connect(served.port) as peer:
            sids = []
            for token in tokens:
                sids.append(sid := peer.stream_id())
                peer.send(peer.headers(sid, fields=leg_fields(token), end_stream=True))
            for sid in sids:
                status, body, end = answer(peer, sid)
                assert (status, end) == ("200", "END_STREAM") and body.endswith(b"data: [DONE]\n\n"), body[-200:]
            assert served.defences == []
            status, body, _ = ask(peer, leg_fields(tokens[0]))
            assert status == "503" and served.defences == ["leg_token"]
        assert not served.listener.server.legs and not len(served.listener.server.parked)


def test_a_body_is_refused_and_its_producer_request_aborted(model, producer):
    """A token with a body (Envoy sends none: the rendered request went to the producer from the worker):
    the stream reset, and the exchange closed as a request whose client left, so its producer request
    is aborted, as the coupled server aborts it."""
    with Served(model, producer) as served:
        token, exchange = served.park()
        with Peer.connect(served.port) as peer:
            _, _, end = ask(peer, leg_fields(token), body=b"x" * 100)
            assert end == "CANCEL" and "leg_body" in served.defences
            assert peer.alive()
        request_id = exchange.ctx.exchange.request_id
    wait_for(lambda: any(request_id in a for a in json.loads(http_get(producer + "/sim/aborted")[1])),
             "the producer request aborted", timeout=10)  # fmt: skip


def test_the_frame_layers_bounds_hold_on_the_leg_listener(model, producer):
    """The ext_proc port's HTTP/2 bounds (``test_http2_attacks``) on the leg listener, tightened to be
    seen quickly: a connection that never sends the preface is closed, one idle after its answer gets
    GOAWAY, one past the connection bound is closed at once, and a rapid reset flood ends with GOAWAY
    ENHANCE_YOUR_CALM; each counted as ``leg_<defence>``."""
    limits = dataclasses.replace(front.LIMITS, preface_timeout=0.4, idle_timeout=0.4, max_connections=3,
                                 reset_burst=50, reset_rate=1.0)  # fmt: skip
    with Served(model, producer, limits) as served:
        silent = Peer(served.port, preface=False)
        assert silent.wait_closed(5) and "leg_preface_timeout" in served.defences
        silent.close()
        token, _ = served.park(stream=False)
        with Peer.connect(served.port) as peer:
            status, body, _ = ask(peer, leg_fields(token))
            assert status == "200" and json.loads(body)["object"] == "chat.completion"
            assert peer.frames(5, until=lambda f: f.kind == wire.GOAWAY)[-1].kind == wire.GOAWAY
            assert "leg_idle_timeout" in served.defences
        held = [Peer.connect(served.port) for _ in range(3)]
        surplus = Peer(served.port)
        assert surplus.wait_closed(5) and "leg_max_connections" in served.defences
        surplus.close()
        for peer in held[1:]:
            peer.close()
        flood, cancel = held[0], wire.CANCEL.to_bytes(4, "big")
        chunk = b""
        for _ in range(200):
            sid = flood.stream_id()
            chunk += flood.headers(sid, fields=leg_fields("forged"), end_stream=True) + frame(wire.RST_STREAM, 0, sid, cancel)
        flood.try_send(chunk)
        goaway = flood.frames(10, until=lambda f: f.kind == wire.GOAWAY)[-1]
        assert goaway.kind == wire.GOAWAY and goaway.error == "ENHANCE_YOUR_CALM"
        assert "leg_rapid_reset" in served.defences
        flood.close()


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
    """The ext_proc side (``ExternalProcessor.serve_stream`` fed Envoy's messages): on a stream whose
    Envoy has the leg (its metadata says so), the reply to the headers asks for none of the response,
    the rewrite names this worker's leg and a token, sends no body, and the stream ends there; with
    ``Parked.most`` requests waiting, the next is refused with a 503 in the client's shape, before any
    producer. On a stream of an Envoy without the leg, the same worker rewrites as without one."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from grpc.aio import EOF

    from derender.extproc import http2
    from derender.extproc.server import ExternalProcessor

    def messages() -> list:
        headers = pb.HttpHeaders()
        for key, value in {":method": "POST", ":path": "/v1/chat/completions", "x-derender-leg": "forged"}.items():
            headers.headers.headers.append(base_pb2.HeaderValue(key=key, raw_value=value.encode()))
        body = json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        return [pb.ProcessingRequest(request_headers=headers),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)), EOF]  # fmt: skip

    async def stream(processor, capable: bool = True) -> list:
        inbox, replies = messages(), []

        async def read():
            return inbox.pop(0)

        async def write(reply) -> None:
            replies.append(reply)

        set_ = http2.METADATA.set(dict([leg_package.CAPABLE]) if capable else {})
        try:
            await processor.serve_stream(read, write, encoded=False)
        finally:
            http2.METADATA.reset(set_)
        return replies

    async def run() -> None:
        async with Listener(model, producer) as listener:
            processor = ExternalProcessor(listener.router, leg=listener.server)
            first, rewrite = await stream(processor)
            assert "x-derender-leg" in first.request_headers.response.header_mutation.remove_headers  # the client's
            mode = first.mode_override
            assert (mode.request_body_mode, mode.response_header_mode, mode.response_body_mode) == (
                mode.BUFFERED, mode.SKIP, mode.NONE)
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
            first, rewrite, *_ = await stream(processor, capable=False)  # an Envoy without the leg
            assert not first.HasField("mode_override") and not len(listener.server.parked)
            common = rewrite.request_body.response
            sets = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
            assert "x-derender-worker" not in sets and json.loads(common.body_mutation.body)["stream"] is True

    asyncio.run(run())


def test_sigterm_lets_the_answers_on_the_leg_finish(plain_stack, qwen3_dir, sim, script, qwen3_tokenizer):  # noqa: F811
    """``test_reliability``'s drain with the response leg: a stream in flight on the worker's leg (its
    ext_proc stream long over) runs to [DONE] after SIGTERM, new requests are refused, and the filter
    exits once it is done."""
    from test_reliability import drains

    drains(plain_stack, qwen3_dir, sim, script, qwen3_tokenizer, ("--response-leg", "worker"), envoy_config.response_leg)
