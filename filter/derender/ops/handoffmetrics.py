"""The metrics of the prefill/decode handoff (``stages.handoff``); in ``metrics.REGISTRY`` beside the others."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from .metrics import REGISTRY

HANDOFFS = Counter(
    "derender_prefill_handoffs",
    "Requests through the prefill/decode handoff, by outcome: remote (the decode took the prefill's KV), "
    "local (every prefill replica tried failed: the decode prefilled itself), short (under "
    "--pd-min-prompt-tokens: decode alone), cached (routing knows the decode replica holds most of the prompt), "
    "client (the client named its own kv_transfer_params)",
    ["outcome"],
    registry=REGISTRY,
)
PREFILL_ERRORS = Counter(
    "derender_prefill_errors", "Prefill calls that failed, by replica", ["replica"], registry=REGISTRY
)
PREFILL_SECONDS = Histogram(
    "derender_prefill_seconds",
    "How long the prefill call took, by outcome",
    ["outcome"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
    registry=REGISTRY,
)
