"""Token budgets per key with the response leg in the worker (``serve --response-leg worker``): the
budget holds a stream's events while it asks Redis for more, so the leg's translation of a chunk
waits, becomes a task, and the producer's reading pauses behind it (``extproc.leg.producer``). The
budget tests of ``test_quota`` that run on its shared fleet run again here, on a fleet (two filter
processes, one Redis) whose answers take the leg, with the same expectations."""

from __future__ import annotations

import pytest
import test_quota
from leg_stacks import borrow


borrow(test_quota, globals(), {"fleet"})  # its tests on its shared fleet, under the same names


@pytest.fixture(scope="module")
def fleet(qwen3_dir, redis_server, tmp_path_factory):
    f = test_quota.Fleet(qwen3_dir, redis_server, tmp_path_factory, leg=True)
    yield f
    f.stop()
