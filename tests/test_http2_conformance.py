"""The ext_proc port speaks HTTP/2 as RFC 9113 and RFC 7541 say: h2spec's sections, as cases on raw
frames (``h2cases.py``), against the filter's own server. Each case names what the RFC allows; the
filter must give the first of them. (``bench/http2_suite.py`` runs the same cases against grpc.aio for
the table in docs/operations.md.)"""

from __future__ import annotations

import pytest
from h2cases import CASES, run


@pytest.mark.parametrize("case", CASES, ids=[f"{c.section} {c.title}" for c in CASES])
def test_case(h2_target, case):
    got = run(case, h2_target.port)
    assert got == case.expect[0], f"{case.section} {case.title}: got {got!r}, expected {case.expect[0]!r}"


def test_the_filter_survives_the_suite(h2_target):
    """After every case: the filter still serves its own health check and Envoy's clients."""
    from stack import http_post

    status, body = http_post(h2_target.envoy_url + "/v1/chat/completions",
                             {"model": "qwen3", "messages": [{"role": "user", "content": "still here"}]}, timeout=30)
    assert status == 200, body
    log = h2_target.filter.log.read_text(errors="replace")
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]
