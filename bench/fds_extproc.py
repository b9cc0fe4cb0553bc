"""The filter answering response bodies in FULL_DUPLEX_STREAMED mode, for the benchmark only.

Production uses STREAMED: Envoy sends each producer body chunk and waits for exactly
one reply, so the filter can merge the events of one chunk but never two chunks.
FULL_DUPLEX_STREAMED allows M:N replies, so this variant sends translated bytes from
a writer task: whatever accumulated while the previous write was in flight goes out
as one ``StreamedBodyResponse``, and chunks that translate to nothing get no reply.
Everything else (routing, rendering, vLLM's generator per stream) is the production
``ExternalProcessor``'s. Streaming chat only: the buffered mode_override of
non-streaming responses is not exercised here.

    python bench/fds_extproc.py --model DIR [vllm flags] --port 9011 --producer URL --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc
from derender.extproc import workers
from derender.endpoints.chat import ChatExchange
from derender.options import add_model_arguments, model_spec
from derender.translate.errors import HTTPError
from derender.extproc.server import ExternalProcessor, _header_map, immediate
from derender.extproc.health import add_health
from derender.translate.model import Model
from derender.routing.producer import UPSTREAM_HEADER, Producer
from derender.endpoints.router import Router
from derender.exchange import Reply
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc


class _Coalescer:
    """Client bytes -> as few streamed body replies as the gRPC stream allows."""

    def __init__(self, context) -> None:
        self.context = context
        self.pending: list[bytes] = []
        self.end = False
        self.ready = asyncio.Event()
        self.task = asyncio.ensure_future(self._write())

    def add(self, data: bytes, end: bool) -> None:
        if data:
            self.pending.append(data)
        self.end = self.end or end
        if data or end:
            self.ready.set()

    async def _write(self) -> None:
        while True:
            await self.ready.wait()
            await asyncio.sleep(0)  # let chunks that already arrived add to this reply
            self.ready.clear()
            body, self.pending = b"".join(self.pending), []
            end = self.end
            streamed = pb.StreamedBodyResponse(body=body, end_of_stream=end)
            common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
            await self.context.write(pb.ProcessingResponse(response_body=pb.BodyResponse(response=common)))
            if end:
                return

    async def drain(self) -> None:
        if self.end:
            await self.task

    def cancel(self) -> None:
        self.task.cancel()


class FullDuplexProcessor(ExternalProcessor):
    async def Process(self, request_iterator, context) -> None:
        exchange: ChatExchange | None = None
        complete = False
        out: _Coalescer | None = None
        self.active += 1
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    routed = await self.router.route(_header_map(message.request_headers), message.request_headers.end_of_stream)
                    if isinstance(routed, Reply):
                        complete = True
                        await context.write(immediate(routed.status, routed.body, routed.content_type))
                        return
                    exchange = routed
                    await context.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
                elif kind == "request_body" and exchange is not None:
                    try:
                        rewrite = await exchange.request_body(message.request_body.body)
                    except HTTPError as exc:
                        complete = True
                        await context.write(immediate(exc.status, exc.body()))
                        return
                    await context.write(self._request_rewrite(rewrite))
                elif kind == "response_headers" and exchange is not None:
                    headers = _header_map(message.response_headers)
                    start = exchange.response_headers(int(headers.get(":status", "0") or 0), headers.get(UPSTREAM_HEADER))
                    complete = message.response_headers.end_of_stream
                    await context.write(self._response_start(start))
                    if exchange.streaming:
                        out = _Coalescer(context)
                elif kind == "response_body" and out is not None and exchange is not None:
                    body = message.response_body
                    out.add(await exchange.response_chunk(body.body, body.end_of_stream), body.end_of_stream)
                    if body.end_of_stream:
                        complete = True
                        await out.drain()
                elif kind == "response_trailers":
                    if out is not None:
                        out.add(b"", True)
                        await out.drain()
                    await context.write(pb.ProcessingResponse(response_trailers=pb.TrailersResponse()))
                elif kind == "request_trailers":
                    await context.write(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        finally:
            self.active -= 1
            if out is not None:
                out.cancel()
            if exchange is not None:
                exchange.close(complete)


async def serve(model: Model, producer_url: str, host: str, port: int, reuse_port: bool) -> None:
    producer = Producer(producer_url)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(FullDuplexProcessor(Router(model, producer)), server)
    await add_health(server)  # Envoy's cluster health check, as for the filter
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    try:
        await server.wait_for_termination()
    finally:
        await producer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--producer", required=True)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    model = Model(model_spec(args))
    return workers.run(lambda reuse_port: serve(model, args.producer, args.host, args.port, reuse_port), args.port, args.workers)


if __name__ == "__main__":
    raise SystemExit(main())
