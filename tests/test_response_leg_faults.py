"""Faults with the response leg in the worker (``serve --response-leg worker``): the fault tests of
``test_reliability`` that run on the shared stacks (a producer that breaks off, stalls or sends garbage
mid-stream, a client that leaves, Envoy's idle timeout, a slow reader held back, the connection limit)
run again here on stacks whose answers take the leg, with the same expectations. Its fixtures that put
another Envoy in front of the shared filter get ``envoy_config.response_leg`` too."""

from __future__ import annotations

import pytest
import test_reliability
from leg_stacks import agent_stack, borrow, plain_stack, with_the_leg  # noqa: F401  (the shared stacks, with the leg)
from test_reliability import (  # noqa: F401  (the fixtures the borrowed tests use)
    faulty,
    short_idle_envoy,
    small_buffer_envoy,
    two_connection_envoy,
)


# Not here: the fixtures whose tests are about Envoy's producer cluster (unused with the leg: a second
# replica behind it, a dead one) or start a filter of their own (``spare``, ``staller``), and the drain
# test, which starts a filter of its own too (test_response_leg.py has the drain with the leg).
BORROWED_FIXTURES = {"faulty", "short_idle_envoy", "small_buffer_envoy", "two_connection_envoy"}
OWN_FIXTURES = {n for n, v in vars(test_reliability).items() if "Fixture" in type(v).__name__} - BORROWED_FIXTURES
borrow(test_reliability, globals(), {"sim", "client", "agents", "plain_stack", "agent_stack", *BORROWED_FIXTURES},
       leave=frozenset({*OWN_FIXTURES, "test_sigterm_drains_open_streams_and_refuses_new_ones"}))  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _leg_envoys():
    """``test_reliability``'s Envoys, started for this file, with the leg's config."""
    mp = pytest.MonkeyPatch()
    mp.setattr(test_reliability, "start_envoy", with_the_leg(test_reliability.start_envoy))
    yield
    mp.undo()
