"""A stream that ends early shuts vLLM's generator chain, in process with vLLM's real objects.

The filter drives ``chat_completion_stream_generator`` by hand; mid-stream it is
suspended three async generators deep. If an early end (client gone, an error
event, a stall) leaves that chain suspended, asyncio's finalizer tries
``aclose()`` on each generator at garbage collection, fails with "asynchronous
generator is already running" and logs "Task exception was never retrieved" at
ERROR level: three lines per cut stream in a production log. The exchange runs
inside a running event loop, as in the ext_proc server, so asyncio's generator
hooks are installed as they are there.
"""

from __future__ import annotations

import asyncio
import gc
import json
import types

import pydantic_core
import pytest

IM_END = 151645


@pytest.fixture(scope="module")
def hermes_model(qwen3_dir):
    from derender.translate.model import Model, ModelSpec

    return Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3",), max_model_len=4096,
                           reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True))


class Producer:
    """Stands in for the producer: only records aborts."""

    def __init__(self, stall_timeout: float = 240.0) -> None:
        self.aborted: list[str] = []
        self.stall_timeout = stall_timeout

    def abort_soon(self, request_id: str, why: str, upstream: str | None = None) -> None:
        self.aborted.append(request_id)


def event(ids: list[int], final: bool = False) -> bytes:
    choice = {"index": 0, "finish_reason": "stop" if final else None, "stop_reason": None, "token_ids": ids,
              "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}
    chunk = {"request_id": "generate-tokens-c", "usage": None, "output_mode": "tokens", "choices": [choice]}
    return b"data: " + pydantic_core.to_json(chunk) + b"\n\n"


async def end_client_gone(exchange) -> bytes:
    exchange.close(False)
    return b""


async def end_producer_error(exchange) -> bytes:
    error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    return await exchange.response_chunk(b"data: " + json.dumps(error).encode() + b"\n\n", False)


async def end_invalid_event(exchange) -> bytes:
    return await exchange.response_chunk(b"data: [1, 2]\n\n", False)


async def end_body_cut(exchange) -> bytes:
    return await exchange.response_chunk(b"", True)


async def end_stall(exchange) -> bytes:
    await asyncio.sleep(0.3)  # past the stall timeout (0.1 s here): the watch aborts the producer request
    return await exchange.response_chunk(b"", True)  # the producer's last words


@pytest.mark.parametrize("api", ["chat", "messages"])
@pytest.mark.parametrize("end", [end_client_gone, end_producer_error, end_invalid_event, end_body_cut, end_stall])
def test_a_stream_ended_early_leaves_no_generator_running(hermes_model, qwen3_tokenizer, end, api, monkeypatch):
    """Chat (vLLM's chat generator, the lean path's part of it) and Messages (that generator and
    vLLM's Anthropic converter, driven as two chains on the lean path)."""
    from derender.endpoints.chat import ChatExchange
    from derender.endpoints.messages import LeanMessagesStream, MessagesExchange
    from derender.translate.lean import LeanChatStream

    if api == "chat":
        body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
        exchange_class, lean_class = ChatExchange, LeanChatStream
    else:
        body = {"model": "qwen3", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
        exchange_class, lean_class = MessagesExchange, LeanMessagesStream
    ids = qwen3_tokenizer.encode("<think>\nhm\n</think>\n\nSure, one moment", add_special_tokens=False).ids
    errors: list[dict] = []

    async def main() -> bytes:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        producer = Producer(stall_timeout=0.1)
        exchange = exchange_class(hermes_model, producer, None)
        rewrite = await exchange.request_body(json.dumps(body).encode())
        rewrite.then()  # as the ext_proc server does once the request has gone on
        exchange.response_headers(200)
        sent = b"".join([await exchange.response_chunk(event([i]), False) for i in ids])
        assert type(exchange.stream) is lean_class and exchange.stream.handled >= len(ids) - 2
        sent += await end(exchange)
        exchange.close(True)
        if end is not end_body_cut:  # the producer's body ended: nothing left to abort
            assert producer.aborted, "the producer request was not aborted"
        del exchange
        gc.collect()
        await asyncio.sleep(0.05)  # the finalizer's aclose() tasks, if any, run now
        return sent

    sent = asyncio.run(main())
    gc.collect()
    running = [g.ag_code.co_qualname for g in gc.get_objects() if isinstance(g, types.AsyncGeneratorType) and g.ag_running]
    assert not running, running
    assert not errors, [c.get("message") or repr(c.get("exception")) for c in errors]
    assert b"Sure" in sent  # the tokens before the end reached the client
    if end is not end_client_gone:
        *_, error_event, last_event = sent.rstrip(b"\n").rsplit(b"\n\n", 2)
        if api == "chat":  # an error chunk, then [DONE]
            assert last_event == b"data: [DONE]" and error_event.startswith(b'data: {"error"'), sent[-400:]
        else:  # Anthropic's error event
            assert last_event.startswith(b'event: error\ndata: {"type":"error"'), sent[-400:]
    if end is end_stall:
        assert b"the producer sent nothing for 0.1 s" in sent


def leftovers() -> list[str]:
    gc.collect()
    return [g.ag_code.co_qualname for g in gc.get_objects() if isinstance(g, types.AsyncGeneratorType) and g.ag_running]


@pytest.mark.parametrize("api", ["chat", "messages"])
@pytest.mark.parametrize("answer", ["client gone", "producer error", "answered, then cut"])
def test_a_stream_built_ahead_and_never_used_is_shut(hermes_model, answer, api):
    """The stream state built while the producer is reached, when no stream follows."""
    from derender.endpoints.chat import ChatExchange
    from derender.endpoints.messages import MessagesExchange

    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if api == "messages":
        body["max_tokens"] = 100
    errors: list[dict] = []

    async def main() -> bytes:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        exchange = (ChatExchange if api == "chat" else MessagesExchange)(hermes_model, Producer(), None)
        rewrite = await exchange.request_body(json.dumps(body).encode())
        rewrite.then()
        assert exchange._ready is not None and exchange.stream is None
        out = b""
        if answer == "producer error":
            start = exchange.response_headers(503)
            assert start.buffer and exchange.stream is None
            out, _ = await exchange.response_body(b'{"error": {"message": "busy", "code": 503}}')
        elif answer == "answered, then cut":  # the stream built ahead is the one the answer uses
            ready = exchange._ready
            exchange.response_headers(200)
            assert exchange.stream is ready
        exchange.close(answer != "client gone")
        assert exchange._ready is None
        del exchange
        gc.collect()
        await asyncio.sleep(0.05)
        return out

    out = asyncio.run(main())
    assert not leftovers()
    assert not errors, [c.get("message") or repr(c.get("exception")) for c in errors]
    if answer == "producer error":
        assert b"busy" in out


def test_a_request_that_does_not_stream_builds_nothing_ahead(hermes_model):
    from derender.endpoints.chat import ChatExchange

    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}

    async def main() -> None:
        exchange = ChatExchange(hermes_model, Producer(), None)
        rewrite = await exchange.request_body(json.dumps(body).encode())
        assert rewrite.then is None
        exchange.close(True)

    asyncio.run(main())


def length_event(index: int = 0) -> bytes:
    """The producer's own end of a choice at max_tokens: no more tokens, finish reason length."""
    choice = {"index": index, "finish_reason": "length", "stop_reason": None, "token_ids": []}
    chunk = {"request_id": "generate-tokens-c", "usage": None, "output_mode": "tokens", "choices": [choice]}
    return b"data: " + pydantic_core.to_json(chunk) + b"\n\n"


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_budget_cut_ends_the_stream_as_the_engine_ends_one_at_its_token_limit(hermes_model, qwen3_tokenizer, api):
    """A key's budget ends a stream through the stream's own encoder (``ChatStream.cut``), no producer
    event forged: the client gets the bytes it gets when the producer itself ends the choice there
    with ``length`` (Messages: ``max_tokens``), the events past the limit are dropped, and the
    producer's request is aborted."""
    from derender.endpoints.chat import ChatExchange
    from derender.endpoints.messages import MessagesExchange

    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    if api == "messages":
        body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100}
    ids = qwen3_tokenizer.encode("Bonjour, le monde entier", add_special_tokens=False).ids
    assert len(ids) >= 3
    exchange_class = ChatExchange if api == "chat" else MessagesExchange

    async def run(cut: bool) -> tuple[bytes, list[str]]:
        producer = Producer()
        exchange = exchange_class(hermes_model, producer, "budget")
        rewrite = await exchange.request_body(json.dumps(body).encode())
        if cut:
            assert exchange.limit(2, rewrite, False)
        exchange.response_headers(200)
        out = b""
        for token in ids[:2]:
            out += await exchange.response_chunk(event([token]), False)
        if cut:
            out += await exchange.response_chunk(event([ids[2]]), False)
            assert exchange.held and exchange.generated == 2
            out += await exchange.cut()
            assert not exchange.held
        else:
            out += await exchange.response_chunk(length_event() + b"data: [DONE]\n\n", True)
        exchange.close(True)
        return out, producer.aborted

    cut, aborted = asyncio.run(run(True))
    engine, engine_aborted = asyncio.run(run(False))

    def same(data: bytes) -> bytes:  # the clock's second may turn; a thinking block's signature is random
        import re

        return re.sub(rb'"signature":"[0-9a-f]+"', b'"signature":""', re.sub(rb'"created":\d+', b'"created":0', data))

    assert same(cut) == same(engine)
    assert (b'"finish_reason":"length"' if api == "chat" else b'"stop_reason":"max_tokens"') in cut
    assert aborted == ["generate-tokens-c"] and engine_aborted == []  # the producer request id its events name
