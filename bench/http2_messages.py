"""The ext_proc frame layer alone: CPU (or instructions) per message, in process, no sockets.

    .venv/bin/python bench/http2_messages.py                       # this tree's frame layer
    PYTHONPATH=<checkout>/filter .venv/bin/python bench/http2_messages.py   # another tree's
    .venv/bin/python bench/http2_messages.py --frame-layer h2       # python-hyper's h2 (bench/h2lib)
    .venv/bin/python bench/http2_messages.py --callgrind            # instructions per message, exact

One ``http2.Server`` connection with 64 ext_proc-like streams, fed as a paced producer feeds the
filter: each stream's ~200-byte message arrives in a read of its own, its handler reads it and writes a
reply of the same size, every stream once per loop turn, ``--turns`` turns after as many warm-up
turns. The transport is a stand-in that takes the bytes, so what is measured is the frame layer and
the handler hand-off, the part of a token's cost the transport changes. ``--callgrind`` runs itself
under valgrind twice (``--turns`` and three times as many) and reports the difference per message:
instructions, the same on every run, where the paced benchmark's rounds move by 10 %.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
STREAMS = 64
PATH = "/p"


class Transport:
    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Message:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        return self.data


async def run(turns: int, frame_layer: str) -> float:
    from hpack import Encoder

    from derender.extproc import http2

    connection_class = http2.Connection
    if frame_layer == "h2":
        sys.path.insert(0, str(BENCH / "h2lib"))
        from h2_connection import H2Connection

        connection_class = H2Connection

    async def handler(read, write) -> None:
        while (message := await read()) is not http2.EOF:
            await write(message)

    server = http2.Server({PATH: (Message, handler)})
    connection = connection_class(server)
    transport = Transport()
    connection.connection_made(transport)
    encoder = Encoder()
    fields = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    # The peer's preface: a window as large as Envoy's, so that replies never wait.
    data = (http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0, b"\x00\x04\x7f\xff\xff\xff")
            + http2.frame(http2.SETTINGS, http2.ACK, 0)
            + http2.frame(http2.WINDOW_UPDATE, 0, 0, (0x7FFFFFFF - 65535).to_bytes(4, "big")))
    for i in range(STREAMS):
        data += http2.frame(http2.HEADERS, http2.END_HEADERS, 2 * i + 1, encoder.encode(fields))
    connection.data_received(data)
    for _ in range(3):
        await asyncio.sleep(0)
    message = b"\x00" + (200).to_bytes(4, "big") + bytes(200)
    frames = [http2.frame(http2.DATA, 0, 2 * i + 1, message) for i in range(STREAMS)]
    used = 0.0
    for _ in range(2):  # a warm-up pass, then the measured one
        start = time.process_time()
        for _ in range(turns):
            for f in frames:
                connection.data_received(f)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        used = time.process_time() - start
    assert transport.written > turns * STREAMS * 200, "the replies did not all leave"
    return used / (turns * STREAMS)


def callgrind(turns: int, frame_layer: str) -> float:
    counts = []
    for n in (turns, 3 * turns):
        out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                              __file__, "--turns", str(n), "--frame-layer", frame_layer],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": "0"})  # the same dict layouts every run
        counts.append(int(re.search(r"Collected : (\d+)", out.stderr).group(1)))
    return (counts[1] - counts[0]) / (2 * 2 * turns * STREAMS)  # warm-up and measured passes both ran


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--frame-layer", choices=["own", "h2"], default="own")
    parser.add_argument("--callgrind", action="store_true", help="instructions per message (valgrind), not CPU time")
    args = parser.parse_args()
    if args.callgrind:
        print(f"{callgrind(min(args.turns, 100), args.frame_layer):,.0f} instructions per message")
        return 0
    import uvloop

    per = uvloop.run(run(args.turns, args.frame_layer))
    print(f"{per * 1e6:.2f} us of CPU per message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
