"""The ext_proc server's transports: the filter's own HTTP/2 (``extproc.http2``, the default) and
grpc.aio (``--transport grpcio``). Through Envoy both send the client the same bytes; spoken to by
gRPC's own client, the HTTP/2 one keeps to gRPC's protocol where Envoy never goes: flow control on
a reply larger than the peer's window, a request larger than the filter's window, statuses."""

from __future__ import annotations

import json
import re
import threading

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import DERENDER, Proc, free_port, start_envoy, start_sim, tcp_open

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


@pytest.fixture(scope="module")
def both(qwen3_dir):
    """One simulator; a filter on each transport, each behind its own Envoy."""
    sim, sim_url = start_sim(qwen3_dir)
    procs = [sim]
    out = {}
    try:
        for transport in ("http2", "grpcio"):
            port = free_port()
            flt = Proc(f"filter-{transport}", [*DERENDER, "serve", "--model", qwen3_dir, "--served-model-name", "qwen3",
                                               "--max-model-len", "40960", "--port", str(port), "--producer", sim_url,
                                               "--workers", "1", "--transport", transport]).start()
            procs.append(flt)
            flt.wait(lambda port=port: tcp_open(port), 300)
            envoy, base = start_envoy(port, sim_url)
            procs.append(envoy)
            out[transport] = (port, base, flt)
        yield out
    finally:
        for p in reversed(procs):
            p.stop()


VOLATILE = re.compile(rb'("(?:id|created|created_at|system_fingerprint)":\s*)("[^"]*"|\d+)|((?:chatcmpl|cmpl|msg|resp)_?-?[0-9a-zA-Z]{8,})')


def _same(body: bytes) -> bytes:
    return VOLATILE.sub(lambda m: (m.group(1) or b"") + b"X" if m.group(1) else b"X", body)


REQUESTS = [
    ("POST", "/v1/chat/completions", {"model": "qwen3", "messages": [{"role": "user", "content": "The same bytes, please."}],
                                      "stream": True, "stream_options": {"include_usage": True}}),
    ("POST", "/v1/chat/completions", {"model": "qwen3", "messages": [{"role": "user", "content": "Not streamed."}]}),
    ("POST", "/v1/completions", {"model": "qwen3", "prompt": "Once upon", "max_tokens": 5, "stream": True}),
    ("POST", "/v1/messages", {"model": "qwen3", "max_tokens": 20, "stream": True,
                              "messages": [{"role": "user", "content": "Anthropic, streamed."}]}),
    ("POST", "/v1/chat/completions", {"model": "qwen3", "messages": "not a list"}),  # 400, in OpenAI's shape
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"model": "qwen3", "prompt": "count me"}),
]


@pytest.mark.parametrize("method, path, body", REQUESTS, ids=[f"{m} {p} {i}" for i, (m, p, _) in enumerate(REQUESTS)])
def test_both_transports_send_the_client_the_same_bytes(both, method, path, body):
    got = {}
    for transport, (_, base, _) in both.items():
        r = httpx.request(method, base + path, json=body, timeout=60)
        got[transport] = (r.status_code, r.headers.get("content-type"), _same(r.content))
    assert got["http2"] == got["grpcio"]
    assert got["http2"][0] in (200, 400) and len(got["http2"][2]) > 20


def _headers(method: str, path: str, end: bool) -> pb.ProcessingRequest:
    headers = [(":method", method), (":path", path), (":authority", "test"), ("content-type", "application/json")]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]),
        end_of_stream=end))


def _process(port: int, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20),
                                                              ("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.stream_stream(PROCESS, request_serializer=pb.ProcessingRequest.SerializeToString,
                                     response_deserializer=pb.ProcessingResponse.FromString)
        return list(call(iter(messages), timeout=120))


def test_grpcs_own_client_gets_a_reply_larger_than_its_window(both):
    """/tokenize of a ~30k-token prompt answered in one immediate response (~200 KB): more than gRPC's
    client lets through before its first WINDOW_UPDATE, so the reply waits for the window and goes on."""
    port = both["http2"][0]
    prompt = "gateway " * 30000
    body = json.dumps({"model": "qwen3", "prompt": prompt}).encode()
    replies = _process(port, [_headers("POST", "/tokenize", False),
                              pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "immediate_response"]
    answer = json.loads(replies[1].immediate_response.body)
    assert len(replies[1].immediate_response.body) > 128 << 10
    assert answer["count"] == len(answer["tokens"]) >= 30000
    # The same through Envoy on both transports (Envoy's window is larger: no waiting there).
    for _, base, _ in both.values():
        r = httpx.post(base + "/tokenize", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == answer["tokens"]


def test_grpcs_own_client_sends_a_request_larger_than_the_filters_window(both):
    """A 6 MB request body (JSON padded with whitespace) in one message: past the filter's 4 MiB stream
    window, which it gives back as the bytes arrive."""
    port = both["http2"][0]
    body = b'{"model": "qwen3", "messages": [{"role": "user", "content": "padded"}]' + b" " * (6 << 20) + b"}"
    replies = _process(port, [_headers("POST", "/v1/chat/completions", False),
                              pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    rewrite = json.loads(replies[1].request_body.response.body_mutation.body)
    assert rewrite["token_ids"] and rewrite["stream"] is False


def test_health_and_unknown_methods_answer_as_grpc_does(both):
    for transport, (port, _, _) in both.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, transport
            with pytest.raises(grpc.RpcError) as info:
                stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, transport
            unknown = channel.unary_unary("/no.such.Service/Method")
            with pytest.raises(grpc.RpcError) as info:
                unknown(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, transport


def test_a_stream_the_client_cancels_ends_cleanly(both):
    """gRPC's client cancels a Process stream mid-request (as Envoy resets one whose client left): the
    stream's handler is cancelled without an error in the log, and the server serves the next stream."""
    port, _, flt = both["http2"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PROCESS, request_serializer=pb.ProcessingRequest.SerializeToString,
                                     response_deserializer=pb.ProcessingResponse.FromString)
        stop = threading.Event()

        def requests():
            yield _headers("POST", "/v1/chat/completions", False)
            stop.wait(30)

        responses = call(requests(), timeout=60)
        first = next(responses)
        assert first.WhichOneof("response") == "request_headers"
        responses.cancel()
        stop.set()
    # The server is still whole: a new stream is served.
    replies = _process(port, [_headers("GET", "/v1/models", True)])
    assert replies[0].immediate_response.status.code == 200
    log = flt.log.read_text(errors="replace")
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]


def test_replies_made_in_one_loop_turn_leave_in_one_send(monkeypatch):
    """Two streams on one connection (Envoy puts up to 16 on one) whose messages arrive in one read:
    both replies go out in one send, each on its own stream, then each stream's trailers."""
    import asyncio

    from derender.extproc import http2
    from hpack import Encoder

    sends: list[bytes] = []
    made = http2.Connection.connection_made

    class Counted:  # the real transport, its writes recorded
        def __init__(self, transport):
            self.transport = transport

        def __getattr__(self, name):
            return getattr(self.transport, name)

        def write(self, data):
            sends.append(bytes(data))
            self.transport.write(data)

    monkeypatch.setattr(http2.Connection, "connection_made", lambda self, transport: made(self, Counted(transport)))

    async def handler(read, write):
        message = await read()
        await write(pb.ProcessingResponse(request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=message.request_headers.headers.headers[1].raw_value)))))
        assert await read() is http2.EOF

    def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
        out, at = [], 0
        while at + 9 <= len(data):
            length = int.from_bytes(data[at:at + 3], "big")
            out.append((data[at + 3], data[at + 4], int.from_bytes(data[at + 5:at + 9], "big"), data[at + 9:at + 9 + length]))
            at += 9 + length
        return out

    async def run() -> list[bytes]:
        server = http2.Server({PROCESS: (pb.ProcessingRequest.FromString, handler)})
        port = free_port()
        await server.start("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        encoder = Encoder()
        out = http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0)
        for stream_id, path in ((1, "/one"), (3, "/three")):
            block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", PROCESS), (":authority", "t"),
                                    ("content-type", "application/grpc"), ("te", "trailers")])
            message = _headers("POST", path, True).SerializeToString()
            out += http2.frame(http2.HEADERS, http2.END_HEADERS, stream_id, block)
            out += http2.frame(http2.DATA, http2.END_STREAM, stream_id, b"\x00" + len(message).to_bytes(4, "big") + message)
        writer.write(out)  # both streams' requests in one write: one read for the server
        received = b""
        while len([f for f in frames(received) if f[0] == http2.HEADERS and f[1] & http2.END_STREAM]) < 2:  # the trailers
            received += await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        await server.stop()
        return received

    received = asyncio.run(run())
    data = [(s, pb.ProcessingResponse.FromString(p[5:])) for kind, _, s, p in frames(received) if kind == http2.DATA]
    assert {s: r.request_headers.response.body_mutation.body for s, r in data} == {1: b"/one", 3: b"/three"}
    replies = [send for send in sends if {s for kind, _, s, _ in frames(send) if kind == http2.DATA} == {1, 3}]
    assert len(replies) == 1, [[(k, s) for k, _, s, _ in frames(send)] for send in sends]


@pytest.mark.parametrize("size", [0, 1, 100, 127, 128, 129, 16383, 16384, 16385, 2_097_151, 2_097_152, 4_000_000])
def test_a_streamed_chunks_reply_in_wire_form_is_protobufs(size):
    """The reply to each streamed chunk is written by hand (``messages.encoded_body_reply``), not built
    as four protobuf messages: its bytes are what protobuf writes for the same reply, at every length
    where a length's varint grows a byte (an empty body: the body cleared), and they parse back to it."""
    from derender.extproc.messages import body_reply, encoded_body_reply

    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    built = body_reply(body)
    encoded = encoded_body_reply(body)
    assert encoded == built.SerializeToString()
    assert encoded.SerializeToString() == built.SerializeToString()  # what the HTTP/2 transport sends
    assert pb.ProcessingResponse.FromString(encoded) == built
    assert built.response_body.response.body_mutation.clear_body == (size == 0)


@given(body=st.binary(max_size=70_000))
def test_any_streamed_chunks_reply_in_wire_form_is_protobufs(body):
    from derender.extproc.messages import body_reply, encoded_body_reply

    assert encoded_body_reply(body) == body_reply(body).SerializeToString()
