"""``derender serve --workers auto``: one worker at start, more as they fill, up to the cores.

A worker is one event loop. While one loop has room, a second only adds its own wake-ups and splits
Envoy's few ext_proc connections (each connection's messages then cost a wake-up on either side),
so the filter starts with one and adds a worker when the saturation signal says a loop is full
(docs/performance.md, "When to scale").

- ``Board``: a shared anonymous memory map the supervisor makes before its first fork; one slot a
  worker. The worker writes its loop's busy ratio (its thread's CPU time over the last ``WINDOW``
  seconds of wall time) and how many connections carry its streams; the supervisor writes a count
  it raises to ask the worker to hand one connection to the others.
- ``Scaler``: the supervisor's decision each second, from the slots alone (no I/O): fork a worker
  when one is busy past ``busy_at`` and none has room; move a connection from a busy worker to one
  with room while their connection counts differ by two or more, or the one with room has none.
- Moving a connection: the busy worker sends that connection a graceful GOAWAY. Its open streams
  finish on it; Envoy opens a new connection for new streams when its others are full, and the
  kernel (SO_REUSEPORT) gives the new one to any worker listening on the port: repeated while the
  counts still differ. A worker with room and no connection at all takes one from a busy worker that
  has any: with the response leg (``extproc.leg``) a request's leg runs on the worker whose ext_proc
  connection brought it, and Envoy's short ext_proc streams fit on one connection per Envoy thread.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..ops.busy import WINDOW, BusyRatio  # a worker younger than WINDOW is not judged busy

EVERY = 1.0  # seconds between a worker's reports and the supervisor's decisions
MOVE_SETTLE = 2.0  # seconds between two connections moved (the last one's streams end, Envoy reconnects)
BUSY_AT = 0.7  # the busy ratio past which a worker is full (docs/performance.md)

# A slot: what the worker writes (busy ratio, connections with streams, listening 0/1), then what the
# supervisor writes (connections it has asked the worker to move). Each side writes only its own bytes.
_WORKER = struct.Struct("=dqq")
_ASKED = struct.Struct("=q")
_SLOT = _WORKER.size + _ASKED.size


class Board:
    """Slots shared by the supervisor and its forked workers (an anonymous shared memory map)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._map = mmap.mmap(-1, _SLOT * slots)

    def clear(self, slot: int) -> None:
        _WORKER.pack_into(self._map, slot * _SLOT, 0.0, 0, 0)

    # -- the worker's side
    def report(self, slot: int, busy: float, connections: int) -> None:
        _WORKER.pack_into(self._map, slot * _SLOT, busy, connections, 1)

    def moves(self, slot: int) -> int:
        return _ASKED.unpack_from(self._map, slot * _SLOT + _WORKER.size)[0]

    # -- the supervisor's side
    def reading(self, slot: int) -> tuple[float, int, bool]:
        busy, connections, listening = _WORKER.unpack_from(self._map, slot * _SLOT)
        return busy, connections, bool(listening)

    def ask_move(self, slot: int) -> None:
        _ASKED.pack_into(self._map, slot * _SLOT + _WORKER.size, self.moves(slot) + 1)


@dataclass(frozen=True)
class Reading:
    """One worker's slot as the supervisor reads it."""

    slot: int
    busy: float
    connections: int
    listening: bool
    age: float  # seconds since its fork


FORK = "fork"
MOVE = "move"


class Scaler:
    """When to fork another worker, and when to move a connection off a busy one."""

    def __init__(self, most: int, busy_at: float = BUSY_AT, window: float = WINDOW) -> None:
        self.most = most
        self.busy_at = busy_at
        self.window = window
        self._forked = float("-inf")
        self._moved = float("-inf")

    def decide(self, readings: Sequence[Reading], now: float) -> tuple[str, int] | None:
        """``(FORK, -1)``, ``(MOVE, slot)`` (that worker hands one connection on), or None."""
        judged = [r for r in readings if r.listening and r.age >= self.window]
        hot = max(judged, key=lambda r: r.busy, default=None)
        if hot is None or hot.busy < self.busy_at:
            return None
        roomy = [r for r in readings if r.listening and r.slot != hot.slot and r.busy < self.busy_at / 2]
        if roomy:
            fewest = min(r.connections for r in roomy)
            # Two more than a worker with room, or any while one has none: with the response leg Envoy's
            # ext_proc streams last only a render, its one thread holds one connection, and every request's
            # leg runs where that connection is.
            if (hot.connections >= fewest + 2 or hot.connections > fewest == 0) and now - self._moved >= MOVE_SETTLE:
                self._moved = now
                return MOVE, hot.slot
            return None
        if len(readings) < self.most and now - self._forked >= self.window:
            self._forked = now
            return FORK, -1
        return None


# The worker's seat on the board: set in a worker that ``workers.run`` forked with a board.
_seat: tuple[Board, int] | None = None


def sit(board: Board, slot: int) -> None:
    global _seat
    _seat = (board, slot)


def start(connections: Callable[[], int], move_one: Callable[[], bool]) -> asyncio.Task | None:
    """In a worker with a seat (call from its loop once it listens): report every ``EVERY`` seconds,
    and hand a connection on when asked. ``connections()``: how many carry streams and may be moved;
    ``move_one()``: retire the busiest of them."""
    if _seat is None:
        return None
    board, slot = _seat
    return asyncio.get_running_loop().create_task(_report(board, slot, connections, move_one), name="derender-scale")


async def _report(board: Board, slot: int, connections: Callable[[], int], move_one: Callable[[], bool]) -> None:
    busy = BusyRatio(WINDOW)
    board.report(slot, busy.sample(), connections())  # 0.0: the window's first sample
    seen = board.moves(slot)
    while True:
        await asyncio.sleep(EVERY)
        asked = board.moves(slot)
        if asked != seen:
            seen = asked
            move_one()
        board.report(slot, busy.sample(), connections())


def workers_flag(value: str) -> str | int:
    """``--workers``: ``auto`` or a count of at least 1."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto or a count of at least 1")
    return count


def workers_flag_count(value: str) -> int:
    """``--max-workers``: a count of at least 1."""
    count = workers_flag(value)
    if count == "auto":
        raise argparse.ArgumentTypeError("--max-workers takes a count")
    return int(count)


def _ratio(value: str) -> float:
    try:
        ratio = float(value)
    except ValueError:
        ratio = -1.0
    if not 0 < ratio <= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a share above 0 and at most 1")
    return ratio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``derender serve``'s sizing flags."""
    parser.add_argument(
        "--workers",
        type=workers_flag,
        default="auto",
        help="filter processes sharing the port with SO_REUSEPORT: a number, or auto (the default): one at "
        "start, another when a worker's loop is busy past --scale-busy and none has room, up to --max-workers",
    )
    parser.add_argument(
        "--max-workers",
        type=workers_flag_count,
        default=os.cpu_count() or 1,
        help="--workers auto: at most this many (default: the CPU count)",
    )
    parser.add_argument(
        "--scale-busy",
        type=_ratio,
        default=BUSY_AT,
        metavar="RATIO",
        help=f"--workers auto: the share of {WINDOW:g} s a worker's loop is on a CPU past which it is full "
        f"(default {BUSY_AT})",
    )
