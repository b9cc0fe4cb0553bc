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


def check(address: str, service: str = "", timeout: float = 2.0) -> bool:
    """True if the gRPC server at ``address`` answers ``SERVING`` for ``service``."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == SERVING


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m derender.extproc.health HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    ok = check(*args)
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
