"""The standard gRPC health service (``grpc.health.v1.Health``) on the ext_proc port.

Envoy's cluster health check (``grpc_health_check``), Kubernetes' ``grpc``
probes, ``derender up`` and the compose file all ask it. The filter loads its
model before it opens the port, so it answers ``SERVING`` as soon as it
listens, and ``NOT_SERVING`` once it starts draining on SIGTERM.

``python -m derender.extproc.health HOST:PORT`` checks a filter from a shell (exit 0
when it is serving): the compose health check uses it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio

from . import http2

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVING = health_pb2.HealthCheckResponse.SERVING


async def add_health(server: grpc.aio.Server) -> aio.HealthServicer:
    """Register the health service; overall health and ext_proc's are ``SERVING``."""
    servicer = aio.HealthServicer()
    for service in ("", EXT_PROC_SERVICE):
        await servicer.set(service, SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


class Http2Health:
    """``grpc.health.v1.Health/Check``: SERVING until ``enter_graceful_shutdown``, as grpc's servicer."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self.services = set(services)
        self.serving = True

    async def enter_graceful_shutdown(self) -> None:
        self.serving = False

    async def check(self, read, write) -> None:
        request = await read()
        if request is http2.EOF:
            return
        if request.service not in self.services:
            raise http2.Status(http2.NOT_FOUND, "unknown service")
        status = health_pb2.HealthCheckResponse.SERVING if self.serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await write(health_pb2.HealthCheckResponse(status=status))

    def methods(self) -> http2.Methods:
        return {"/grpc.health.v1.Health/Check": (health_pb2.HealthCheckRequest.FromString, self.check)}


def check(
    address: str,
    service: str = "",
    timeout: float = 2.0,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
) -> bool:
    """True if the gRPC server at ``address`` answers ``SERVING`` for ``service``; with ``ca``, over TLS
    (and with ``cert`` / ``key``, a client certificate, for a filter run with ``--tls-client-ca``)."""
    if ca:
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        credentials = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == SERVING


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m derender.extproc.health",
        description="ask a filter's gRPC health service (exit 0 when it is serving)",
    )
    parser.add_argument(
        "address",
        metavar="HOST:PORT",
        help="HOST as serve --host takes it: an address, or a network for this machine's address in it",
    )
    parser.add_argument("service", nargs="?", default="")
    parser.add_argument(
        "--tls-ca", default=None, metavar="FILE", help="TLS: the CA that signed the filter's certificate"
    )
    parser.add_argument("--tls-cert", default=None, metavar="FILE", help="TLS: a client certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="TLS: its private key")
    parser.add_argument("--server-name", default=None, help="TLS: the name the filter's certificate carries")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from .listen import address

    ok = check(
        address(args.address),
        args.service,
        ca=args.tls_ca,
        cert=args.tls_cert,
        key=args.tls_key,
        server_name=args.server_name,
    )
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
