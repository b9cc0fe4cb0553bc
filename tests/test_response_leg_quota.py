"""Token budgets per key with the response leg in the worker (``serve --response-leg worker``): the
budget holds a stream's events while it asks Redis for more, so the leg's translation of a chunk
waits, becomes a task, and the producer's reading pauses behind it (``extproc.leg.producer``). The
budget tests of ``test_quota`` that run on its shared fleet run again here, on a fleet (two filter
processes, one Redis) whose answers take the leg, with the same expectations."""

from __future__ import annotations

import inspect

import pytest
import test_quota


def _borrow() -> None:
    """``test_quota``'s tests on its ``fleet``, here under the same names."""
    for name, test in list(vars(test_quota).items()):
        if name.startswith("test_") and callable(test) and "fleet" in inspect.signature(test).parameters:
            globals()[name] = test


_borrow()


@pytest.fixture(scope="module")
def fleet(qwen3_dir, redis_server, tmp_path_factory):
    f = test_quota.Fleet(qwen3_dir, redis_server, tmp_path_factory, leg=True)
    yield f
    f.stop()
