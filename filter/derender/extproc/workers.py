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
from collections.abc import Awaitable, Callable
from typing import Any

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
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main())
    except BaseException:
        log.exception("%s failed", name)
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


def run(serve: Serve, port: int, workers: int) -> int:
    """Serve with ``workers`` processes (forked, sharing ``port``); returns the exit code."""
    if workers > 1 and port == 0:
        raise ValueError("--workers > 1 needs a fixed --port (every worker binds it)")
    # The model's objects live as long as the process: the garbage collector leaves them
    # alone instead of walking them all (tens of ms on a request now and then), and forked
    # workers do not touch (and so copy) every page that holds one.
    gc.freeze()
    if workers <= 1:
        run_one(serve)
        return 0
    children: dict[int, int] = {}
    parent = os.getpid()
    for index in range(workers):
        pid = os.fork()
        if pid == 0:  # worker
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() handles it (--quota-config)
                _die_with_parent()
                if os.getppid() != parent:
                    os._exit(0)
                log.info("worker %d of %d: pid %d", index + 1, workers, os.getpid())
                run_one(serve, reuse_port=True)
            except BaseException:  # a worker must never return into the parent's code
                log.exception("worker %d failed", index + 1)
                code = 1
            finally:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = index
    return _supervise(children)


def _supervise(children: dict[int, int]) -> int:
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def hangup(signum, _frame) -> None:  # reload (the quota file): every worker does it itself
        for pid in children:
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, hangup)
    code = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        index = children.pop(pid, None)
        if index is None:
            continue
        if not stopping:
            log.error("worker %d (pid %d) exited with status %d; stopping", index + 1, pid, status)
            code = 1
            stop(signal.SIGTERM, None)
    return code
