"""Prefill on one producer, decode on another (issue 46): the filter runs vLLM's ``kv_transfer_params``
handoff. Real processes: two simulators in their roles (``--kv-role prefill`` answers where its KV
blocks wait, as vLLM's NIXL connector does; ``--kv-role decode`` takes them from it and skips its own
prefill), the filter with ``--prefill`` and, beside it, one without, each behind its own Envoy, in front
of the same decode simulator. What each producer got is read from its ``/sim/numbered``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from stack import Proc, free_port, http_get, http_post, start_envoy, start_filter, start_sim

LONG = "Please summarise the following: " + "the quick brown fox jumps over the lazy dog " * 8


def served(qwen3_dir: str, *flags: str) -> list[str]:
    return ["--model", qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096", "--workers", "1", *flags]


def sim_stats(url: str) -> dict:
    return json.loads(http_get(url + "/sim/stats")[1])


def bodies(url: str) -> list[dict]:
    return [body for _, body in json.loads(http_get(url + "/sim/numbered")[1])]


class PD:
    def __init__(self, qwen3_dir: str) -> None:
        self.procs: list[Proc] = []
        try:
            sim, self.prefill = start_sim(qwen3_dir, "--kv-role", "prefill", "--prefill-us-per-token", "20")
            self.procs.append(sim)
            sim, self.decode = start_sim(qwen3_dir, "--kv-role", "decode", "--prefill-us-per-token", "20")
            self.procs.append(sim)
            flt, port = start_filter(served(qwen3_dir, "--prefill", self.prefill, "--pd-min-prompt-tokens", "32"),
                                     self.decode)
            self.procs.append(flt)
            envoy, self.handoff = start_envoy(port, self.decode)
            self.procs.append(envoy)
            flt, port = start_filter(served(qwen3_dir), self.decode)
            self.procs.append(flt)
            envoy, self.plain = start_envoy(port, self.decode)
            self.procs.append(envoy)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def pd(qwen3_dir):
    p = PD(qwen3_dir)
    yield p
    p.stop()


@pytest.fixture()
def faults(pd):
    http_post(pd.prefill + "/sim/config", {})
    yield pd
    http_post(pd.prefill + "/sim/config", {})


def stream(base: str, text: str) -> list[dict]:
    """A streamed chat's events, without what differs between any two requests (ids, timestamps)."""
    body = {"model": "qwen3", "messages": [{"role": "user", "content": text}], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as client, client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    out = []
    for event in events[:-1]:
        parsed = json.loads(event)
        parsed.pop("id"), parsed.pop("created")
        out.append(parsed)
    return out


def test_the_client_gets_the_same_stream_and_the_decode_takes_the_prefills_kv(pd):
    prefilled, decoded = sim_stats(pd.prefill)["kv_handoff"], sim_stats(pd.decode)["kv_handoff"]
    with_handoff = stream(pd.handoff, LONG)
    alone = stream(pd.plain, LONG)
    assert with_handoff == alone  # the client cannot tell; usage counts the prompt once
    assert with_handoff[-1]["usage"]["prompt_tokens"] > 32
    asked = bodies(pd.prefill)[-1]  # what the prefill producer got: one token, not streamed, asking for a decode
    assert asked["stream"] is False and asked["sampling_params"]["max_tokens"] == 1
    assert asked["kv_transfer_params"]["do_remote_decode"] is True
    decode_bodies = bodies(pd.decode)
    params = decode_bodies[-2]["kv_transfer_params"]  # the handoff's decode request (the plain one came after)
    assert params["do_remote_prefill"] is True and params["remote_port"] == int(pd.prefill.rsplit(":", 1)[1])
    assert decode_bodies[-2]["stream"] is True and decode_bodies[-1]["kv_transfer_params"] is None
    assert sim_stats(pd.prefill)["kv_handoff"]["answered"] == prefilled["answered"] + 1
    assert sim_stats(pd.decode)["kv_handoff"]["remote_prefills"] == decoded["remote_prefills"] + 1
    assert sim_stats(pd.decode)["kv_handoff"]["local_prefills"] == decoded["local_prefills"]


def test_a_short_prompt_goes_to_decode_alone(pd):
    before = sim_stats(pd.prefill)["received"]
    assert stream(pd.handoff, "hi") == stream(pd.plain, "hi")
    assert sim_stats(pd.prefill)["received"] == before


@pytest.mark.parametrize("knobs", [{"http_error": 500}, {"fault": "truncated_json"}, {"fault": "garbage"}])
def test_a_failed_or_malformed_prefill_leaves_the_decode_to_prefill_itself(faults, knobs):
    """The prefill replica errs, or answers what is not JSON: nothing of it reaches the decode request,
    which prefills itself; the client sees its answer, as without the handoff."""
    pd = faults
    http_post(pd.prefill + "/sim/config", knobs)
    got = stream(pd.handoff, LONG)
    http_post(pd.prefill + "/sim/config", {})
    assert got == stream(pd.plain, LONG)
    assert bodies(pd.decode)[-2]["kv_transfer_params"] is None


def test_a_client_that_leaves_during_prefill_reaches_no_decode_producer(faults):
    pd = faults
    http_post(pd.prefill + "/sim/config", {"hold_after": 0})  # the prefill answers nothing until released
    before = sim_stats(pd.decode)["received"]
    marker = "leaving-marker " + LONG

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "qwen3", "messages": [{"role": "user", "content": marker}]}
            leaving = asyncio.create_task(client.post(pd.handoff + "/v1/chat/completions", json=body))
            for _ in range(100):
                await asyncio.sleep(0.05)
                if sim_stats(pd.prefill)["held"]:
                    break
            assert sim_stats(pd.prefill)["held"]  # the prefill call is under way
            leaving.cancel()
            await asyncio.gather(leaving, return_exceptions=True)
            for _ in range(100):  # the prefill producer sees its client (the filter) leave
                await asyncio.sleep(0.05)
                if not sim_stats(pd.prefill)["held"]:
                    break

    asyncio.run(run())
    http_post(pd.prefill + "/sim/config", {})
    http_post(pd.prefill + "/sim/release", {})
    assert not sim_stats(pd.prefill)["held"]
    assert sim_stats(pd.decode)["received"] == before


def test_a_dead_prefill_replica_is_passed_over(qwen3_dir, pd):
    """The first prefill replica cannot be reached: the second one serves (one other is tried)."""
    dead = f"http://127.0.0.1:{free_port()}"
    flt, port = start_filter(served(qwen3_dir, "--prefill", f"{dead},{pd.prefill}", "--pd-min-prompt-tokens", "32"),
                             pd.decode)
    envoy, base = start_envoy(port, pd.decode)
    try:
        answered = sim_stats(pd.prefill)["kv_handoff"]["answered"]
        for i in range(4):  # whichever replica the prompt's hash ranks first
            assert stream(base, f"{i} " + LONG) == stream(pd.plain, f"{i} " + LONG)
        assert sim_stats(pd.prefill)["kv_handoff"]["answered"] == answered + 4
    finally:
        envoy.stop()
        flt.stop()


def test_a_decode_replica_whose_kv_events_show_the_prompt_skips_the_prefill(qwen3_dir, pd):
    """With kv-events routing, a decode replica that its own KV cache events show holding the prompt's
    blocks (here: after the prompt was answered once) prefills the rest itself: no prefill call."""
    from derender.ops import envoy_config
    from test_kv_events import start_publishing_sim

    from stack import start_cluster_envoy, wait_for

    sim, url, pub, replay = start_publishing_sim(qwen3_dir, 4096, "--kv-role", "decode")
    procs = [sim]
    try:
        metrics = free_port()
        flt, port = start_filter(served(qwen3_dir, "--routing", "kv-events", "--kv-events", f"tcp://127.0.0.1:{pub}",
                                        "--kv-events-replay", f"tcp://127.0.0.1:{replay}", "--kv-events-topic", "kv",
                                        "--metrics-port", str(metrics), "--prefill", pd.prefill,
                                        "--pd-min-prompt-tokens", "32"), url)
        procs.append(flt)
        envoy, base, _ = start_cluster_envoy(port, envoy_config.producer_cluster("producer", [url], "kv-events"), "pd")
        procs.append(envoy)

        def read() -> float:
            text = http_get(f"http://127.0.0.1:{metrics}/metrics")[1].decode()
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("derender_kv_events_batches_total{")
                       and ('outcome="received"' in line or 'outcome="replayed"' in line))

        answered = sim_stats(pd.prefill)["kv_handoff"]["answered"]
        wait_for(lambda: stream(base, "warm up") and True, "the gateway answering", 60)
        first = stream(base, "kv " + LONG)  # prefilled on the prefill replica, then decoded
        assert sim_stats(pd.prefill)["kv_handoff"]["answered"] == answered + 1
        wait_for(lambda: read() >= sim_stats(url)["kv_event_batches"], "the filter has read the decode's events")
        again = stream(base, "kv " + LONG)
        assert again == first
        assert sim_stats(pd.prefill)["kv_handoff"]["answered"] == answered + 1  # no second prefill
        assert bodies(url)[-1]["kv_transfer_params"] is None
    finally:
        for proc in reversed(procs):
            proc.stop()
