"""Prefix and precise routing (``test_prefix_routing``) with the response leg in the worker: the same
simulators and Envoy, the filter serving ``--response-leg worker``, so that its workers balance the
producer replicas themselves (``extproc.leg.wire.Replicas``: the prefix key's own order of the replicas
with bounded load, the replica precise routing names first). Where a request went is read from the
simulators' own counters, as there."""

from __future__ import annotations

import pytest
from stack import envoy_counter
from test_prefix_routing import (  # noqa: F401  (collected here, with this file's fixture)
    Replicas,
    test_a_conversations_turns_stick_to_one_replica_and_find_their_prefix_cached,
    test_metrics_count_each_replicas_requests_prompt_and_cached_tokens,
    test_two_tenants_conversations_spread_over_the_replicas,
)


@pytest.fixture(scope="module", params=["prefix", "precise"])
def replicas(request, qwen3_dir):
    stack = Replicas(qwen3_dir, request.param, leg=True)
    stack.mode = request.param
    try:
        yield stack
        # Every answer took the leg; Envoy's producer cluster carried none of them.
        assert envoy_counter(stack.admin, "cluster.derender_leg.upstream_rq_total") > 0
        assert envoy_counter(stack.admin, "cluster.producer.upstream_rq_total") == 0
    finally:
        stack.stop()
