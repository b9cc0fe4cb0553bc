"""Traces with the response leg in the worker (``serve --response-leg worker``): the tracing tests of
``test_tracing`` that run on its shared ``traced`` stack run again here on one whose answers take the
leg. The producer request is the worker's own there, so its ``traceparent`` is the filter's ``producer``
span's (no router span of Envoy's stands between them), which those tests accept too."""

from __future__ import annotations

import pytest
import test_tracing
from leg_stacks import borrow, with_the_leg
from test_tracing import fast_export, receiver  # noqa: F401  (the fixtures the borrowed tests use)


# Not here: the shipped layouts' test, which starts their own Envoy configs (they have the leg, and
# test_tracing's filter takes it by its default, --response-leg auto).
borrow(test_tracing, globals(), {"traced"}, leave=frozenset({"test_each_shipped_layouts_envoy_traces_into_one_trace_with_the_filter"}))


@pytest.fixture(scope="module")
def traced(qwen3_dir, receiver, fast_export):  # noqa: F811
    """``test_tracing.traced`` with the response leg in the worker, and Envoy's config for it."""
    mp = pytest.MonkeyPatch()
    mp.setattr(test_tracing, "start_envoy", with_the_leg(test_tracing.start_envoy))
    try:
        t = test_tracing.start(qwen3_dir, receiver, True, "--trace-sample-ratio", "0", "--response-leg", "worker")
    finally:
        mp.undo()
    yield t
    t.stop()
