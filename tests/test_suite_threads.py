"""The suite's own footing: what tests that start work on threads depend on."""

from __future__ import annotations

import logging
import threading

from _pytest.logging import LogCaptureHandler, catching_logs


def test_pytests_log_capture_holds_while_a_thread_creates_loggers():
    """Each test phase's log capture walks every logger while the parity suite's background start
    imports modules (creating loggers): the walk must not fail (tests/threadsafe_logging.py)."""
    names = [f"derender.test.threads.{i}" for i in range(20000)]
    done = threading.Event()

    def create() -> None:
        for name in names:
            logging.getLogger(name).propagate = False
        done.set()

    thread = threading.Thread(target=create, daemon=True)
    walks = 0
    try:
        thread.start()
        while not done.is_set():
            with catching_logs(LogCaptureHandler()):
                walks += 1
        thread.join()
    finally:
        done.wait()
        manager = logging.Logger.manager
        with logging._lock:  # type: ignore[attr-defined]
            for name in names:
                manager.loggerDict.pop(name, None)
            manager.loggerDict.pop("derender.test.threads", None)
            manager.loggerDict.pop("derender.test", None)
    assert walks > 1, "the loggers were all created before the capture walked them once"
