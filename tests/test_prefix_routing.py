"""Prefix-cache-aware routing (issue 13): the real Envoy, the filter, several simulators.

The producer cluster is the one ``derender up --replicas N --routing MODE`` writes
(``envoy_config.producer_cluster`` in ``envoy/multi.yaml``); each simulator models vLLM's
prefix cache and counts the generate requests it got and the prompt tokens it found cached.
Where a request went is read from the simulators' own counters, never from the filter.
"""

from __future__ import annotations

import json
import math
import re
import signal
import threading
import time
import urllib.request

import pytest
from derender.ops import envoy_config
from derender.routing.balance import Balancer, Decision
from derender.routing.prefix import BlockHasher, PrefixKey, answer_marker

from stack import (Proc, free_port, http_get, http_post, metric_total, start_cluster_envoy, start_filter, start_sim,
                   wait_for)

REPLICAS = 3
SYSTEM = {t: f"You are the assistant of tenant {t}. " + " ".join(f"rule {t}-{i}: be exact." for i in range(60)) for t in "AB"}


class Replicas:
    """Envoy + one filter (``--routing MODE``, one worker) + ``REPLICAS`` simulators in one cluster."""

    def __init__(self, model_dir: str, mode: str, health_interval: str | None = None, leg: bool = False) -> None:
        self.procs: list[Proc] = []
        self.sims: list[tuple[Proc, str]] = []
        try:
            for _ in range(REPLICAS):
                self.sims.append(start_sim(model_dir, "--prefix-cache-blocks", "4096", "--enable-prompt-tokens-details"))
            urls = [url for _, url in self.sims]
            self.metrics = free_port()
            self.filter, port = start_filter(["--model", model_dir, "--served-model-name", "qwen3", "--routing", mode,
                                              "--workers", "1", "--metrics-port", str(self.metrics),
                                              *(["--response-leg", "worker"] if leg else [])], ",".join(urls))
            self.procs.append(self.filter)
            producer = envoy_config.producer_cluster("producer", urls, mode)
            if health_interval:  # how long a dead replica stays in the ring after its last good check
                producer["health_checks"][0]["interval"] = health_interval
            envoy, self.base, self.admin = start_cluster_envoy(
                port, producer, f"replicas-{mode}", edit=envoy_config.response_leg if leg else None)
            self.procs.append(envoy)
            self.envoy = envoy
            # Every replica passed Envoy's first health check: none is picked before it is known up.
            wait_for(lambda: self.healthy() == REPLICAS, "every replica healthy in Envoy", 30)
        except Exception:
            self.stop()
            raise

    def healthy(self) -> int:
        """Producer replicas Envoy's health check calls healthy."""
        _, body = http_get(f"http://127.0.0.1:{self.admin}/clusters")
        return sum(1 for line in body.decode().splitlines()
                   if line.startswith("producer::") and line.endswith("health_flags::healthy"))

    def active(self) -> int:
        """Requests Envoy counts active on the producer cluster (what its bounded load sees)."""
        _, body = http_get(f"http://127.0.0.1:{self.admin}/stats?filter=^cluster\\.producer\\.upstream_rq_active$")
        [line] = [line for line in body.decode().splitlines() if line.startswith("cluster.producer.upstream_rq_active:")]
        return int(line.rsplit(":", 1)[1])

    def filter_streams(self) -> float:
        """Exchanges open in the filter (``derender_active_streams``): one closes after its
        routing's in-flight count is released."""
        return metric_total(f"http://127.0.0.1:{self.metrics}/metrics", "derender_active_streams")

    def stats(self) -> list[dict]:
        return [json.loads(http_get(url + "/sim/stats")[1]) if proc.popen and proc.popen.poll() is None else None
                for proc, url in self.sims]

    def received(self) -> list[int]:
        return [s["received"] if s else -1 for s in self.stats()]

    def chat(self, messages: list[dict], **more) -> dict:
        status, body = http_post(self.base + "/v1/chat/completions",
                                 {"model": "qwen3", "messages": messages, "max_tokens": 40, **more}, timeout=60)
        assert status == 200, body
        return json.loads(body)

    def turn(self, messages: list[dict]) -> tuple[int, str]:
        """One turn; the replica that served it (by the simulators' counters) and the answer."""
        before = self.received()
        answer = self.chat(messages)["choices"][0]["message"]["content"]
        after = self.received()
        served = [i for i, (a, b) in enumerate(zip(before, after)) if b == a + 1]
        assert len(served) == 1, (before, after)
        return served[0], answer

    def conversation(self, tenant: str, first: str, turns: int) -> list[int]:
        """The replicas that served each turn of one conversation."""
        messages = [{"role": "system", "content": SYSTEM[tenant]}, {"role": "user", "content": first}]
        where = []
        for k in range(turns):
            replica, answer = self.turn(messages)
            where.append(replica)
            # Each turn adds more than one 64-token stretch of the precise index (the answer echoes it).
            follow = f"and then, step {k}? " + "Explain every detail of that step, slowly. " * 8
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]
        return where

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        for p, _ in self.sims:
            p.stop()


@pytest.fixture(scope="module", params=["prefix", "precise"])
def replicas(request, qwen3_dir):
    stack = Replicas(qwen3_dir, request.param)
    stack.mode = request.param
    yield stack
    stack.stop()


def test_a_conversations_turns_stick_to_one_replica_and_find_their_prefix_cached(replicas):
    for c in range(3):
        where = replicas.conversation("A", f"Conversation {c}: plan a trip to city number {c}.", 4)
        assert len(set(where)) == 1, where
    # Each turn after the first found its conversation's earlier prompt in that replica's cache.
    stats = [s for s in replicas.stats() if s]
    assert sum(s["cached_prompt_tokens"] for s in stats) > 0.6 * sum(s["prompt_tokens"] for s in stats)


def test_two_tenants_conversations_spread_over_the_replicas(replicas):
    served = set()
    for tenant in "AB":
        for c in range(6):
            served.add(replicas.conversation(tenant, f"Tenant {tenant} conversation {c}: summarise report {c}.", 1)[0])
    assert len(served) >= 2, served  # consistent hashing by conversation, not one replica for all


def test_metrics_count_each_replicas_requests_prompt_and_cached_tokens(replicas):
    """derender_routed_* per replica agree with what each simulator counted itself."""
    from prometheus_client.parser import text_string_to_metric_families

    replicas.conversation("B", "Metrics: count me, replica by replica.", 3)
    ports = [url.rsplit(":", 1)[1] for _, url in replicas.sims]

    def counted() -> dict[tuple[str, str], float]:
        text = http_get(f"http://127.0.0.1:{replicas.metrics}/metrics")[1].decode()
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("derender_routed_") and s.name.endswith("_total"):
                    assert s.labels["routing"] == replicas.mode
                    key = (s.name, s.labels["replica"].rsplit(":", 1)[-1])
                    out[key] = out.get(key, 0) + s.value
        return out

    stats = replicas.stats()
    want = {("derender_routed_requests_total", p): s["received"] for p, s in zip(ports, stats) if s["received"]}

    def agree():
        got = counted()
        return all(got.get(k) == v for k, v in want.items()) and got
    got = wait_for(agree, "the routed request counters to match the simulators'")
    for p, s in zip(ports, stats):
        assert got.get(("derender_routed_prompt_tokens_total", p), 0) == s["prompt_tokens"]
        # The producers' own counts, from their usage: every non-streaming answer carries it (a
        # stream only when asked for usage), so never more than a simulator counted.
        assert got.get(("derender_routed_cached_prompt_tokens_total", p), 0) <= s["cached_prompt_tokens"]
    assert sum(v for (name, _), v in got.items() if name == "derender_routed_cached_prompt_tokens_total") > 0


# -- a client cannot steer (issue 24) -------------------------------------------------------------

# One request per API, streaming and not: the routing headers a client forges must change nothing.
API_REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Steer me, if you can."}], "max_tokens": 8}),
    "completions": ("/v1/completions", {"prompt": "Steer me, if you can, by a header.", "max_tokens": 8}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Steer me, Anthropic way."}], "max_tokens": 8}),
    "responses": ("/v1/responses", {"input": "Steer me, Responses way.", "max_output_tokens": 8}),
}
VARYING = {"x-request-id", "x-envoy-expected-rq-timeout-ms", "x-envoy-attempt-count"}


def check_forged_routing_headers_change_nothing(stack: Replicas) -> None:
    """For every API, streaming and not: the same request with forged routing headers (the replica
    override, the prefix key, the cluster, any x-derender-* header) reaches the same replica as
    without them, and that producer receives the same headers and body as it did without them."""
    addresses = ["127.0.0.1:" + url.rsplit(":", 1)[1] for _, url in stack.sims]

    def send(path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
        # The last request must be over where load is counted, or the replica may change for a
        # reason that has nothing to do with the headers: in Envoy's accounting (its bounded load
        # counts a replica's active requests) and in the filter's (precise routing counts its own
        # requests in flight per replica, until the exchange closes); both can trail the client's
        # last byte.
        wait_for(lambda: stack.active() == 0 and stack.filter_streams() == 0,
                 "no request active at the producers in Envoy, no exchange open in the filter")
        before = stack.received()
        status, out = http_post(stack.base + path, body, timeout=60, headers=headers)
        assert status == 200, out
        after = stack.received()
        [served] = [i for i, (a, b) in enumerate(zip(before, after)) if b == a + 1]
        url = stack.sims[served][1]
        seen = json.loads(http_get(url + "/sim/headers")[1])[-1]
        request = json.loads(http_get(url + "/sim/requests")[1])[-1]
        request.pop("request_id", None)
        attempts[served] = {k.lower(): v for k, v in seen.items()}.get("x-envoy-attempt-count")
        return served, {k.lower(): v for k, v in seen.items() if k.lower() not in VARYING}, request

    def why() -> dict:
        """What Envoy saw, for a failure's message: per replica its active and total requests, connect
        failures and health; the cluster's retries and health-check failures; its last access-log lines."""
        _, clusters = http_get(f"http://127.0.0.1:{stack.admin}/clusters")
        hosts: dict[str, list[str]] = {}
        for line in clusters.decode().splitlines():
            name, _, rest = line.partition("::")
            if name == "producer" and re.match(r"127\.0\.0\.1:\d+::(rq_active|rq_total|cx_connect_fail|health_flags)::", rest):
                address, stat, value = rest.split("::", 2)
                hosts.setdefault(str(addresses.index(address)), []).append(f"{stat}={value}")
        _, stats = http_get(f"http://127.0.0.1:{stack.admin}/stats?filter=^cluster\\.producer\\."
                            "(upstream_rq_retry.*|upstream_cx_connect_fail|upstream_rq_pending_total|health_check\\.failure"
                            "|lb_healthy_panic|lb_recalculate_zone_structures|membership_change|upstream_cx_destroy.*_with_active_rq)$")
        log = stack.envoy.log.read_text(errors="replace").splitlines() if stack.envoy.log else []
        return {"hosts": hosts, "stats": [s for s in stats.decode().split("\n") if s and not s.endswith(": 0")],
                "filter_streams": stack.filter_streams(),
                "access": [line[-160:] for line in log if '"POST ' in line][-4:], "attempt": dict(attempts)}

    attempts: dict[int, str | None] = {}

    for api, (path, body) in API_REQUESTS.items():
        for stream in (False, True):
            full = {"model": "qwen3", **body, "stream": stream}
            served, headers, request = send(path, full)
            forged = {
                "x-gateway-destination-endpoint": addresses[(served + 1) % len(addresses)],
                "x-derender-prefix-key": "0" * 64,
                "x-derender-cluster": "derender",
                "x-derender-anything": "forged",
            }
            for _ in range(2):
                where, *got = send(path, full, forged)
                assert got == [headers, request], (api, stream, forged)
                if stack.mode != "least-request":  # there Envoy picks anew each time, header or not
                    assert where == served, (why(), api, stream, where, served)
            # Only the filter's own: the cluster it chose, and the key in the hashing modes.
            assert {k for k in headers if k.startswith("x-derender-")} <= {"x-derender-prefix-key", "x-derender-cluster"}
            assert headers["x-derender-cluster"] == "producer"
            assert "x-gateway-destination-endpoint" not in headers
            assert ("x-derender-prefix-key" in headers) == (stack.mode != "least-request"), headers

    # A dozen conversations naming one replica spread over the replicas as they do without it.
    named = addresses[0]
    where = set()
    for c in range(12):
        full = {"model": "qwen3", "messages": [{"role": "user", "content": f"Conversation {c}: aim me at one replica."}],
                "max_tokens": 4}
        where.add(send("/v1/chat/completions", full, {"x-gateway-destination-endpoint": named})[0])
    assert len(where) >= 2, where


def test_forged_routing_headers_change_nothing(replicas):
    check_forged_routing_headers_change_nothing(replicas)


@pytest.mark.parametrize("mode", ["prefix", "precise"])
def test_the_ring_holds_every_replica_as_soon_as_envoy_calls_them_healthy(qwen3_dir, mode):
    """Envoy merges health changes over 1 s by default before its workers' balancers see them, so
    for up to a second after it calls a replica healthy (on its admin page too) the ring lacks that
    replica, and then keys move onto it: a conversation changes replicas mid-way (this once failed
    the forged-headers check above). The producer cluster has no merge window: from the moment
    every replica is healthy, keys spread over all of them and stay where they are."""
    stack = Replicas(qwen3_dir, mode)  # returns once Envoy calls every replica healthy
    try:
        def replica(key: int) -> int:
            before = stack.received()
            body = {"model": "qwen3", "messages": [{"role": "user", "content": f"Key number {key}, please."}],
                    "max_tokens": 1}
            assert http_post(stack.base + "/v1/chat/completions", body, timeout=60)[0] == 200
            [served] = [i for i, (a, b) in enumerate(zip(before, stack.received())) if b == a + 1]
            return served

        first = [replica(key) for key in range(30)]
        time.sleep(1.5)  # past the default window, had it been on
        assert set(first) == set(range(REPLICAS)), first  # 30 keys on 3 replicas: all hit but ~1 in 10^5 rings
        assert [replica(key) for key in range(30)] == first
    finally:
        stack.stop()


def test_least_request_spreads_a_conversations_turns(qwen3_dir):
    """The contrast the routing modes exist for: Envoy's own balancing does not keep a
    conversation on one replica (so the modes' stickiness above is theirs)."""
    stack = Replicas(qwen3_dir, "least-request")
    try:
        where = []
        for c in range(3):
            where += [tuple(stack.conversation("A", f"Conversation {c}: plan trip {c}.", 4))]
        assert any(len(set(w)) > 1 for w in where), where
        stack.mode = "least-request"
        check_forged_routing_headers_change_nothing(stack)
    finally:
        stack.stop()


def test_bounded_load_holds_when_one_conversation_is_hot(replicas):
    """Nine streams of one prompt at once: consistent hashing alone would put all on one replica;
    hash_balance_factor 125 caps a replica near 1.25x the mean as they arrive."""
    for _, url in replicas.sims:
        assert http_post(url + "/sim/config", {"hold_after": 1})[0] == 200
    messages = [{"role": "system", "content": SYSTEM["A"]}, {"role": "user", "content": "The hot question, asked by everyone."}]
    results: list[int] = []

    def one():
        body = json.dumps({"model": "qwen3", "messages": messages, "max_tokens": 20, "stream": True}).encode()
        request = urllib.request.Request(replicas.base + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()
            results.append(r.status)

    threads = []
    try:
        for i in range(9):
            threads.append(threading.Thread(target=one, daemon=True))
            threads[-1].start()
            # One at a time: each pick sees the ones before it active.
            wait_for(lambda: sum(len(s["held"]) for s in replicas.stats()) == i + 1, f"{i + 1} streams held")
        held = [len(s["held"]) for s in replicas.stats()]
        # Envoy's bounded load: a host takes a request while its active requests are at most
        # ceil(ceil((active in the cluster + 1) x 1.25) / hosts); the last of 9 saw 8 active.
        slots = math.ceil(math.ceil((8 + 1) * 1.25) / REPLICAS)
        assert max(held) <= slots + 1 < 9, held  # without the bound all 9 would share one key's replica
        assert max(held) >= 2, held  # the key still sticks: not spread like round robin
    finally:
        for _, url in replicas.sims:
            http_post(url + "/sim/config", {"hold_after": None})
            http_post(url + "/sim/release", {})
        for t in threads:
            t.join(30)
    assert results == [200] * 9


def test_a_replica_killed_mid_run_loses_only_its_request_in_flight(qwen3_dir):
    """The replica a conversation sticks to dies with one stream in flight: that stream ends
    broken, every later request is served (Envoy retries the refused connection elsewhere,
    then the health check takes the replica out of the ring) and the conversation sticks anew."""
    for mode in ("prefix", "precise"):
        stack = Replicas(qwen3_dir, mode)
        try:
            messages = [{"role": "system", "content": SYSTEM["B"]}, {"role": "user", "content": "Conversation X: start."}]
            home, answer = stack.turn(messages)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]
            proc, url = stack.sims[home]
            http_post(url + "/sim/config", {"hold_after": 1})
            broken: list[object] = []

            def in_flight():
                body = json.dumps({"model": "qwen3", "messages": messages, "max_tokens": 20, "stream": True}).encode()
                request = urllib.request.Request(stack.base + "/v1/chat/completions", data=body,
                                                 headers={"content-type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=60) as r:
                        broken.append(r.read())
                except Exception as exc:  # noqa: BLE001 - what the client of the lost stream sees
                    broken.append(exc)

            t = threading.Thread(target=in_flight, daemon=True)
            t.start()
            wait_for(lambda: json.loads(http_get(url + "/sim/stats")[1])["held"], "the stream held on its replica")
            proc.stop(signal.SIGKILL)
            t.join(30)
            assert broken and (isinstance(broken[0], Exception) or b"[DONE]" not in broken[0] or b"error" in broken[0]), broken
            later = [stack.turn(messages)[0] for _ in range(4)]
            assert home not in later and len(set(later)) == 1, (home, later)
            for c in range(4):  # new conversations too
                assert stack.conversation("A", f"after the loss {c}", 1)[0] != home
        finally:
            stack.stop()


@pytest.mark.parametrize("mode", ["prefix", "precise"])
def test_every_key_of_a_dead_replica_is_retried_elsewhere_before_the_health_check_notices(qwen3_dir, mode):
    """Until the health check marks a dead replica, the consistent hash still sends its keys there;
    the refused connection is retried on another replica, found by walking the ring from the key's
    place past the dead replica's entries. A replica holds runs of adjacent entries (several
    longer than 5 on a ring of 3), so too few host selection attempts leave some of its keys on it:
    a 503. The health check waits a minute here, so every request meets the dead replica in the ring."""
    stack = Replicas(qwen3_dir, mode, health_interval="60s")
    try:
        proc, _ = stack.sims[0]
        proc.stop(signal.SIGKILL)
        failed = []
        for k in range(300):
            messages = [{"role": "system", "content": f"Tenant {k}. " + SYSTEM["A"]}, {"role": "user", "content": "hi"}]
            status, body = http_post(stack.base + "/v1/chat/completions",
                                     {"model": "qwen3", "messages": messages, "max_tokens": 2}, timeout=60)
            if status != 200:
                failed.append((k, status, body[:200]))
        assert stack.healthy() == REPLICAS  # the dead replica was in the ring throughout
        _, stats = http_get(f"http://127.0.0.1:{stack.admin}/stats?filter=^cluster\\.producer\\.upstream_rq_retry$")
        retried = int(stats.decode().strip().rsplit(":", 1)[1])
        assert not failed, failed
        assert retried >= 50, retried  # about a third of the keys hashed onto the dead replica
    finally:
        stack.stop()


def test_precise_routes_later_turns_to_the_replica_holding_them(qwen3_dir):
    stack = Replicas(qwen3_dir, "precise")
    try:
        where = stack.conversation("A", "A long conversation about the weather.", 5)
        assert len(set(where)) == 1

        def route_lines() -> list[str]:
            return [line for line in stack.filter.log.read_text().splitlines() if " route=" in line]

        # A request's log line is written when its ext_proc stream ends, which can come after the
        # client has read the answer's last byte: wait for the fifth turn's line.
        lines = wait_for(lambda: len(route_lines()) >= 5 and route_lines(), "the fifth turn's request log line")
        routes = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines][-5:]
        # Turns 1-2: nothing known beyond the key's prefix (the consistent hash places them);
        # from turn 3 on, the earlier turn's prompt is longer than the key: matched and asked for.
        assert [r["route"] for r in routes] == ["key", "key", "match", "match", "match"], routes
        for r in routes[2:]:
            assert int(r["matched_blocks"]) > int(r["prefix_blocks"]), r
            assert r["replica"] == f"127.0.0.1:{stack.sims[where[0]][1].rsplit(':', 1)[1]}", r
    finally:
        stack.stop()


# -- the key and the precise index, in process ---------------------------------------------------

def rendered(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


def test_the_key_covers_the_first_turn_for_each_template(hf_tokenizer):
    """Qwen3, DeepSeek-R1, gpt-oss: the key is the same for every turn of a conversation, differs
    between conversations of one system prompt, and is vLLM's chain of those blocks."""
    tokenizer = hf_tokenizer
    marker = answer_marker(tokenizer)
    assert marker, "the template's generation prompt was not found"
    hasher = BlockHasher()
    key = PrefixKey(hasher, marker)
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    first = [system, {"role": "user", "content": "Tell me about the tides of the North Sea."}]
    turn1 = rendered(tokenizer, first)
    turn3 = rendered(tokenizer, first + [{"role": "assistant", "content": "They are strong."},
                                         {"role": "user", "content": "Why?"},
                                         {"role": "assistant", "content": "The moon."},
                                         {"role": "user", "content": "And in winter?"}])
    other = rendered(tokenizer, [system, {"role": "user", "content": "Something else entirely, about bread."}])
    k1, covered = key.key(turn1)
    assert key.key(turn3) == (k1, covered) and k1 is not None
    assert key.key(other)[0] != k1
    # vLLM's chain over the first turn up to its answer header, the partial last block included
    assert len(turn1) - len(marker) - 8 <= covered <= len(turn1), (covered, len(turn1))
    n1 = covered // 16
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    chain = hasher.chain(turn1, limit=n1)
    tail = tuple(turn1[n1 * 16 : covered])
    assert k1 == bytes(hash_block_tokens(hasher.hash_fn, chain[-1], tail, None) if tail else chain[-1]).hex()


def test_precise_forgets_a_replica_envoy_did_not_use_and_bounds_load():
    marker = (7, 8)  # the answer header of this made-up template
    balancer = Balancer("precise", PrefixKey(BlockHasher(), marker))
    first = list(range(1000, 1320)) + [7, 8]  # the first turn: 20 blocks then the answer header
    turn2 = first + list(range(2000, 2400)) + [7, 8]
    turn3 = turn2 + list(range(3000, 3400)) + [7, 8]
    for ids in (first, turn2):
        _, d = balancer.route(ids)
        balancer.started(d, "10.0.0.1:8000", 200)
        balancer.finished(d)
    headers, d = balancer.route(turn3)
    assert d.why == "match" and d.chosen == "10.0.0.1:8000"
    assert set(headers) == {"x-derender-prefix-key"}  # the replica never travels as a header
    assert d.matched_blocks > d.key_blocks
    balancer.started(d, "10.0.0.2:8000", 200)  # Envoy used another replica: the asked one is gone
    assert "10.0.0.1:8000" not in balancer.in_flight
    balancer.finished(d)
    headers, d = balancer.route(turn3)  # now known on the replica that served it
    assert d.chosen == "10.0.0.2:8000"
    # Load bound: that replica already has 3 requests of this process in flight, the other none.
    balancer.in_flight.update({"10.0.0.2:8000": 3, "10.0.0.3:8000": 0})
    headers, d = balancer.route(turn3)
    assert d.why == "bound" and d.chosen is None
    assert isinstance(d, Decision) and headers["x-derender-prefix-key"]  # the consistent hash decides
