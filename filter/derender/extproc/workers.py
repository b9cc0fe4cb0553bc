"""``derender serve --workers N``: N filter processes behind one listening port.

The model (vLLM's renderer, tokenizer and parsers) is built once, then the
process forks N workers that share it copy-on-write. Each worker runs its own
event loop (uvloop when installed) and gRPC server bound to the same port
with ``SO_REUSEPORT``, so the kernel spreads Envoy's HTTP/2 connections over
the workers. Envoy keeps every HTTP stream on one gRPC stream, hence on one
worker, which owns that stream's state until it ends. The parent only
supervises: it forwards SIGTERM / SIGINT and stops everything if a worker dies.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from . import scale

# serve(reuse_port) -> the coroutine that runs one process's server until it stops
Serve = Callable[[bool], Awaitable[None]]

log = logging.getLogger("derender.workers")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed: about 10 % less CPU per gRPC message here."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def filter_server(
    model: Any, producer: str, host: str, port: int, routing: Any = None, listener: Any = None, settings: Any = None
) -> Serve:
    """The ext_proc filter for ``model`` as a ``Serve`` (``routing``: a ``RoutingSpec``; ``listener``: the
    port's bounds and TLS, a ``listen.Listener``; ``settings``: the process's ``Settings``)."""
    from .server import serve

    return lambda reuse_port: serve(
        model, producer, host, port, reuse_port=reuse_port, routing=routing, listener=listener, settings=settings
    )


def run_one(serve: Serve, reuse_port: bool = False) -> None:
    """One process serving until it is told to stop."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve(reuse_port))
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()


def _die_with_parent() -> None:
    """Linux: a worker gets SIGTERM if the supervisor is gone (even after SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def fork_helper(name: str, main: Callable[[], Awaitable[None]]) -> int:
    """Fork a helper process beside the workers (the KV events hub) running ``main`` on an event loop
    of its own until it is stopped or its parent is gone; its pid. A helper's death does not stop the
    server: its users carry on without it."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:  # the helper: never returns into the parent's code
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _die_with_parent()
        if os.getppid() != parent:
            os._exit(0)
        gc.freeze()  # what it inherited lives as long as it does (as in ``run``)
        gc.enable()  # off while the parent loaded the model (``cli.cmd_serve``)
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main())
    except BaseException:
        log.exception("%s failed", name)
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


def run(serve: Serve, port: int, workers: int, most: int | None = None, busy_at: float = scale.BUSY_AT) -> int:
    """Serve with ``workers`` processes (forked, sharing ``port``), up to ``most`` as they fill
    (``--workers auto``: ``extproc.scale``); returns the exit code."""
    most = max(most or workers, workers)
    if most > 1 and port == 0:
        raise ValueError("--workers > 1 needs a fixed --port (every worker binds it)")
    # The model's objects live as long as the process: the garbage collector leaves them
    # alone instead of walking them all (tens of ms on a request now and then), and forked
    # workers do not touch (and so copy) every page that holds one. ``derender serve`` loads the
    # model with the collector off (``cli.cmd_serve``), Python's advice for a process that forks:
    # no collection's holes in the pages the workers share, and a start a fifth shorter. Nothing
    # is collected before the freeze: a full collection here costs 0.6-0.8 s and gave back no
    # memory (the same RSS).
    gc.freeze()
    gc.enable()
    if most <= 1:
        run_one(serve)
        return 0
    supervisor = _Supervisor(serve, most, scale.Board(most) if most > workers else None, busy_at)
    for _ in range(workers):
        supervisor.fork()
    return supervisor.run()


class _Supervisor:
    """The parent: forks the workers (more as they fill, with a board), forwards signals, and stops
    everything if a worker dies."""

    def __init__(self, serve: Serve, most: int, board: scale.Board | None, busy_at: float) -> None:
        self.serve = serve
        self.most = most
        self.board = board
        self.scaler = scale.Scaler(most, busy_at) if board is not None else None
        self.parent = os.getpid()
        self.children: dict[int, int] = {}  # pid -> worker index (its slot on the board)
        self.born: dict[int, float] = {}  # worker index -> when it was forked
        self.stopping = False

    def fork(self) -> None:
        index = len(self.born)
        if self.board is not None:
            self.board.clear(index)
        pid = os.fork()
        if pid == 0:
            self._worker(index)
        self.children[pid] = index
        self.born[index] = time.monotonic()

    def _worker(self, index: int) -> None:
        code = 0
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() handles it (--quota-config)
            _die_with_parent()
            if os.getppid() != self.parent:
                os._exit(0)
            if self.board is not None:
                scale.sit(self.board, index)
            log.info("worker %d of %s%d: pid %d", index + 1, "up to " if self.board else "", self.most, os.getpid())
            run_one(self.serve, reuse_port=True)
        except BaseException:  # a worker must never return into the parent's code
            log.exception("worker %d failed", index + 1)
            code = 1
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def stop(self, signum, _frame) -> None:
        self.stopping = True
        self._signal(signal.SIGTERM)

    def hangup(self, signum, _frame) -> None:  # reload (the quota file): every worker does it itself
        self._signal(signal.SIGHUP)

    def _signal(self, signum: int) -> None:
        for pid in self.children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def _scale(self) -> None:
        """One look at the board: fork a worker, or ask a busy one to hand a connection on."""
        assert self.board is not None and self.scaler is not None
        now = time.monotonic()
        readings = [
            scale.Reading(index, *self.board.reading(index), now - self.born[index]) for index in self.children.values()
        ]
        decision = self.scaler.decide(readings, now)
        log.debug("workers: %s -> %s", readings, decision)
        if decision is None or self.stopping:
            return
        what, slot = decision
        busiest = max(r.busy for r in readings)
        if what == scale.FORK:
            log.info(
                "a worker's loop was %.0f %% busy: adding worker %d of up to %d",
                busiest * 100,
                len(self.born) + 1,
                self.most,
            )
            self.fork()
        else:
            log.info(
                "worker %d's loop was %.0f %% busy: it hands a connection to a worker with room",
                slot + 1,
                busiest * 100,
            )
            self.board.ask_move(slot)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGHUP, self.hangup)
        code = 0
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0 if self.scaler is None else os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:  # scaling: nothing exited; look at the board every second
                if not self.stopping:
                    self._scale()
                time.sleep(scale.EVERY)
                continue
            index = self.children.pop(pid, None)
            if index is None:
                continue
            if not self.stopping:
                log.error("worker %d (pid %d) exited with status %d; stopping", index + 1, pid, status)
                code = 1
                self.stop(signal.SIGTERM, None)
        return code
