"""pytest's log capture, safe beside threads that create loggers.

Before every test phase pytest (9.2, ``_pytest.logging.catching_logs.__enter__``) walks
``logging.root.manager.loggerDict.values()`` without logging's lock, to attach its handler to
non-propagating loggers. ``logging.getLogger`` adds to that dict under the lock. A thread that imports
modules while tests run (the parity suite starts the next model's stack and vLLM reference in the
background; an import creates loggers) can add one mid-walk: the test's setup then fails with
"dictionary changed size during iteration" (a fresh-clone CI run did, on gw0). ``install`` gives the
manager a dict whose ``values()`` is a copy taken in one C call, which no other thread can interleave.
"""

from __future__ import annotations

import logging


class LoggerDict(dict):
    """``logging.Manager.loggerDict`` whose ``values()`` is a snapshot (taken while holding the GIL)."""

    def values(self):  # type: ignore[override]
        return list(dict.values(self))


def install() -> None:
    manager = logging.Logger.manager
    logging._acquireLock()  # type: ignore[attr-defined]
    try:
        if not isinstance(manager.loggerDict, LoggerDict):
            manager.loggerDict = LoggerDict(manager.loggerDict)
    finally:
        logging._releaseLock()  # type: ignore[attr-defined]
