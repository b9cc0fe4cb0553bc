"""The transport floor: an ext_proc server that answers every message and changes nothing.

Same stack as the filter (its HTTP/2 transport, ``--transport grpcio`` for grpc.aio; xds-protos,
uvloop, N forked workers on one SO_REUSEPORT port), same Envoy config, and the filter's way of
reading and writing a stream. Response body chunks are sent back as a
body mutation carrying the same bytes, so the floor pays for the bytes going both
ways as the filter does. It works in STREAMED and FULL_DUPLEX_STREAMED modes.

    python bench/echo_extproc.py --port 9010 --workers 2 [--transport grpcio]
"""

from __future__ import annotations

import argparse
import logging

import grpc
from derender.extproc import http2, listen, workers
from derender.extproc.health import EXT_PROC_SERVICE, Http2Health, add_health
from grpc.aio import EOF
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

# The ext_proc method's path (``derender.extproc.server.PROCESS``, which imports vLLM: this server runs
# without it, on any Python that has grpcio, xds-protos, uvloop and hpack; ``bench/echo_pythons.py``).
PROCESS = f"/{pb.DESCRIPTOR.services_by_name['ExternalProcessor'].full_name}/Process"


class EchoProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, full_duplex: bool) -> None:
        self.full_duplex = full_duplex

    async def Process(self, request_iterator, context):  # noqa: N802 - grpc.aio, read()/write() as the filter
        await self.handle(context.read, context.write)

    async def handle(self, read, write) -> None:
        """One ext_proc stream on either transport, as the filter's servicer reads and writes."""
        while (message := await read()) is not EOF:
            await write(self.reply(message))

    def reply(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        if kind == "request_body":
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        if kind == "response_headers":
            return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        if kind == "response_body":
            return pb.ProcessingResponse(response_body=pb.BodyResponse(response=self.echo(message.response_body)))
        if kind == "request_trailers":
            return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    def echo(self, body: pb.HttpBody) -> pb.CommonResponse:
        """The chunk replaced by itself (FULL_DUPLEX_STREAMED: one streamed reply per chunk)."""
        if self.full_duplex:
            streamed = pb.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
            return pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        mutation = pb.BodyMutation(body=body.body) if body.body else pb.BodyMutation(clear_body=True)
        return pb.CommonResponse(body_mutation=mutation)


async def serve(host: str, port: int, full_duplex: bool, reuse_port: bool, transport: str, unix=None) -> None:
    processor = EchoProcessor(full_duplex)
    if transport == "http2":  # the filter's default transport
        health = Http2Health(("", EXT_PROC_SERVICE))
        server = http2.Server({PROCESS: (pb.ProcessingRequest.FromString, processor.handle), **health.methods()})
        await server.start(host, port, reuse_port=reuse_port, unix=unix)
        await server.wait_for_termination()
        return
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    await add_health(server)  # Envoy's cluster health check, as for the filter
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--full-duplex", action="store_true", help="answer FULL_DUPLEX_STREAMED bodies")
    parser.add_argument("--transport", choices=("http2", "grpcio"), default="http2",
                        help="the server: the filter's own HTTP/2 (default, as the filter) or grpc.aio")
    parser.add_argument("--uds", default=None, metavar="PATH", help="also on this Unix socket, as derender serve --uds (http2 only)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    unix = listen.bind_unix(args.uds) if args.uds else None
    try:
        return workers.run(lambda reuse_port: serve(args.host, args.port, args.full_duplex, reuse_port, args.transport, unix),
                           args.port, args.workers)
    finally:
        if unix is not None:
            listen.unbind_unix(unix)


if __name__ == "__main__":
    raise SystemExit(main())
