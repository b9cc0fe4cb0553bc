"""A TCP byte relay between Envoy and the producer: the transport floor of a filter that would sit in
the response path as Envoy's upstream instead of answering ext_proc messages.

Each connection Envoy opens is joined to a new connection to the producer, and whatever either side
sends is written to the other as it is read: one read and one write per producer event, no parsing,
on uvloop like the filter. ``bench/floors.py`` measures it beside Envoy alone and the echo ext_proc.

    python bench/byte_relay.py --port 9020 --target-port 8000
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import uvloop


class Half(asyncio.Protocol):
    """One side of a joined pair: what it reads goes to ``other`` (held until ``other`` is connected)."""

    def __init__(self, other: Half | None = None) -> None:
        self.other = other
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport subclasses
        self.held: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        for data in self.held:
            transport.write(data)
        self.held.clear()

    def give(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
        else:
            self.held.append(data)

    def data_received(self, data: bytes) -> None:
        if self.other is not None:
            self.other.give(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()


class Front(Half):
    """A connection from Envoy: dials the producer and joins the two."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(None)
        self.host, self.port = host, port

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.other = Half(self)
        loop = asyncio.get_running_loop()
        dial = loop.create_task(loop.create_connection(lambda: self.other, self.host, self.port))
        dial.add_done_callback(lambda task: task.exception() and transport.close())


async def serve(port: int, host: str, target_port: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: Front(host, target_port), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="where Envoy connects (loopback)")
    parser.add_argument("--target-host", default="127.0.0.1")
    parser.add_argument("--target-port", type=int, required=True, help="the producer's port")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.target_host, args.target_port))


if __name__ == "__main__":
    main()
