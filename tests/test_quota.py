"""Token budgets per API key (``--quota-config``) with a real Redis, the real Envoy, the simulator and
the official SDKs as clients: refusals in each API's shape with the headers clients read, streams
ended at the budget as a max_tokens cut ends them (streamed and not), exact charges settled in Redis,
two filter processes sharing one key's budget, Redis going away (open and closed), SIGHUP reloads
and ``derender quota show``."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading

import anthropic
import httpx
import openai
import pytest
import yaml
from derender.ops import envoy_config, quota


from agent_turns import QUESTION, WEATHER_FUNCTION, WEATHER_TOOL, tool_call_answer
from stack import DERENDER, Redis, free_port, metric_total, start_envoy, start_filter, start_sim, wait_for

FLAGS = ["--served-model-name", "qwen3", "--max-model-len", "4096", "--workers", "1"]
KEYS = {
    name: f"sk-test-{name}"
    for name in ("rate", "day", "cut", "msgcut", "msgbuf", "respcut", "bufchat", "bufresp", "shared", "free")
}
# A long question: the simulator echoes the prompt's tokens back, so an answer runs as long as it.
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon".split()
LONG = " ".join(WORDS[i % len(WORDS)] for i in range(250))  # about 310 prompt tokens with the template


def quota_file(redis_url: str, **more) -> dict:
    return {
        "redis": redis_url,
        "batch_tokens": 4,
        "reservation": 8,
        "keys": [
            {"name": "rate", "key": KEYS["rate"], "requests_per_minute": 2},
            {"name": "day", "key": KEYS["day"], "tokens_per_day": 100_000},
            {"name": "cut", "key": KEYS["cut"], "tokens_per_day": 500},
            {"name": "msgcut", "key": KEYS["msgcut"], "tokens_per_day": 500, "models": {"qwen3": {"tokens_per_minute": 100_000}}},
            {"name": "respcut", "key": KEYS["respcut"], "tokens_per_day": 500},
            {"name": "msgbuf", "key": KEYS["msgbuf"], "tokens_per_day": 500},
            {"name": "bufchat", "key": KEYS["bufchat"], "tokens_per_day": 500},
            {"name": "bufresp", "key": KEYS["bufresp"], "tokens_per_day": 500},
            {"name": "shared", "key": KEYS["shared"], "tokens_per_day": 3000},
            {"name": "free", "key": KEYS["free"]},
        ],
        **more,
    }


class Fleet:
    """Two filter processes (each behind its own Envoy) on one simulator and one Redis (the quota
    file's, and the Responses store's if ``store``)."""

    def __init__(self, qwen3_dir: str, redis: Redis, tmp_path_factory, filters: int = 2, store: bool = True,
                 extra: tuple[str, ...] = (), leg: bool = False, **more) -> None:
        self.redis = redis
        self.path = tmp_path_factory.mktemp("quota") / "quota.yaml"
        self.path.write_text(yaml.safe_dump(quota_file(redis.url, **more)))
        self.sim, self.sim_url = start_sim(qwen3_dir)
        self.procs = [self.sim]
        self.urls: list[str] = []
        self.metrics_ports: list[int] = []
        keys = [flag for key in [*KEYS.values(), "sk-unlisted"] for flag in ("--api-key", key)]
        self.flags: list[list[str]] = []
        self.ports: list[int] = []
        for _ in range(filters):
            self.metrics_ports.append(free_port())
            flags = ["--metrics-port", str(self.metrics_ports[-1]), "--quota-config", str(self.path), *keys, *extra]
            self.flags.append(["--model", qwen3_dir, *FLAGS, *flags, *(["--responses-store", redis.url] * store)])
            if leg:  # the response leg in the worker (test_response_leg_quota.py)
                self.flags[-1] += ["--response-leg", "worker"]
            flt, port = start_filter(self.flags[-1], self.sim_url)
            envoy, url = start_envoy(port, self.sim_url, edit=envoy_config.response_leg if leg else None)
            self.procs += [flt, envoy]
            self.ports.append(port)
            self.urls.append(url)

    @property
    def filters(self) -> list:
        return self.procs[1::2]

    def restart(self, which: int = 0) -> None:
        """Stop filter process ``which`` and start a new one in its place (its Envoy stays)."""
        self.filters[which].stop()
        self.procs[1 + 2 * which], _ = start_filter(self.flags[which], self.sim_url, port=self.ports[which])

    def openai(self, key: str, which: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls[which] + "/v1", api_key=KEYS.get(key, key), max_retries=0)

    def anthropic(self, key: str, which: int = 0) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.urls[which], api_key=KEYS.get(key, key), max_retries=0)

    def show(self, key: str) -> dict:
        config = quota.load(str(self.path))
        return asyncio.run(quota.show(config, KEYS.get(key, key)))

    def counted(self, name: str, **labels: str) -> float:
        """A counter's value summed over the filter processes, for the samples with ``labels``."""
        return sum(metric_total(f"http://127.0.0.1:{port}/metrics", name, **labels) for port in self.metrics_ports)

    def aborted(self) -> list[str]:
        return httpx.get(self.sim_url + "/sim/aborted").json()

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def fleet(qwen3_dir, redis_server, tmp_path_factory):
    f = Fleet(qwen3_dir, redis_server, tmp_path_factory)
    yield f
    f.stop()


def ask(content: str = "Hi") -> list[dict]:
    return [{"role": "user", "content": content}]


# -- the file ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "entry, says",
    [
        ({"keys": [{"name": "a", "key": "k", "tokens_per_day": -1}]}, "keys[0]: tokens_per_day must be a whole number"),
        ({"keys": [{"name": "a", "key": "k", "token_per_day": 5}]}, "keys[0]: unknown field 'token_per_day'"),
        ({"keys": [{"name": "a b", "key": "k"}]}, "keys[0]: name must be"),
        ({"keys": [{"name": "a"}]}, "keys[0]: give the key once"),
        ({"keys": [{"name": "a", "key_env": "DERENDER_TEST_NO_SUCH_VARIABLE"}]}, "is not set"),
        ({"keys": [{"name": "a", "key": "k"}, {"name": "a", "key": "j"}]}, "keys[1]: key or name 'a' listed twice"),
        ({"keys": [{"name": "a", "key": "k", "burst": 5}]}, "burst needs tokens_per_minute"),
        ({"keys": [], "on_redis_error": "maybe"}, "on_redis_error is open or closed"),
        ({"keys": [], "default": {"key": "k"}}, "the default entry names no key"),
        ({"keys": [{"name": "a", "key": "k", "models": {"m": {"tokens": 1}}}]}, "models.m takes only"),
    ],
)
def test_a_bad_quota_file_is_refused_naming_the_entry(entry, says):
    with pytest.raises(quota.QuotaConfigError, match="quota.yaml: ") as caught:
        quota.parse({"redis": "redis://127.0.0.1:1/0", **entry}, "quota.yaml")
    assert says in str(caught.value)


def test_serve_refuses_a_bad_quota_file_at_start(tmp_path):
    bad = tmp_path / "quota.yaml"
    bad.write_text("keys:\n  - {name: a, key: k, tokens_per_dya: 5}\nredis: redis://127.0.0.1:1/0\n")
    result = subprocess.run([*DERENDER, "serve", "--quota-config", str(bad), "--producer", "http://127.0.0.1:1"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0
    assert f"{bad}: keys[0]: unknown field 'tokens_per_dya'" in result.stderr


# -- admission -------------------------------------------------------------------------------------
def test_requests_per_minute_refused_in_each_clients_shape_with_their_headers(fleet):
    client = fleet.openai("rate")
    first = client.chat.completions.with_raw_response.create(model="qwen3", messages=ask(), max_tokens=4)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    # The other filter process shares the count (one Redis).
    fleet.openai("rate", 1).chat.completions.create(model="qwen3", messages=ask(), max_tokens=4)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="qwen3", messages=ask(), max_tokens=4)
    error = caught.value
    assert error.status_code == 429 and error.body["type"] == "rate_limit_exceeded"
    assert "requests per minute" in error.body["message"]
    assert 1 <= int(error.response.headers["retry-after"]) <= 60
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    # Anthropic's clients: its error shape and its header names.
    with pytest.raises(anthropic.RateLimitError) as refused:
        fleet.anthropic("rate").messages.create(model="qwen3", max_tokens=4, messages=ask())
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert refused.value.response.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert "retry-after" in refused.value.response.headers
    assert fleet.counted("derender_quota_refusals_total", key="rate", limit="requests_per_minute") == 2
    # A key with no limits, and a key the file does not list (no default entry): no headers, no limits.
    for key in ("free", "sk-unlisted"):
        answer = fleet.openai(key).chat.completions.with_raw_response.create(model="qwen3", messages=ask(), max_tokens=4)
        assert not [h for h in answer.headers if h.startswith("x-ratelimit")]


def test_a_request_is_charged_exactly_what_it_used(fleet):
    before = fleet.show("day")["scopes"]["*"]["tokens_used_today"]
    stream = fleet.openai("day").chat.completions.create(
        model="qwen3", messages=ask("Count to five."), max_tokens=50, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in stream if c.usage][-1]
    # max_tokens was reserved; what was not used is given back once the stream is over.
    wait_for(lambda: fleet.show("day")["scopes"]["*"]["tokens_used_today"] == before + usage.total_tokens,
             "the day's count settled to the stream's usage", timeout=10)
    answer = fleet.anthropic("day").messages.create(model="qwen3", max_tokens=50, messages=ask("Count to three."))
    spent = answer.usage.input_tokens + answer.usage.output_tokens
    wait_for(lambda: fleet.show("day")["scopes"]["*"]["tokens_used_today"] == before + usage.total_tokens + spent,
             "the day's count settled to the Messages answer's usage", timeout=10)


# -- while it streams --------------------------------------------------------------------------------
def test_a_stream_ends_at_the_budget_as_a_length_cut(fleet):
    """No max_tokens: the reservation (8) then batches of 4 until the day's 500 are spent; the
    stream ends there with finish_reason length, its usage what was sent, the producer aborted."""
    chunks = list(fleet.openai("cut").chat.completions.create(
        model="qwen3", messages=ask(LONG), stream=True, stream_options={"include_usage": True}))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage.prompt_tokens + usage.completion_tokens >= 500 - 4  # it ran to the budget...
    assert usage.prompt_tokens < 500 < usage.prompt_tokens * 2  # ...which cut it (the echo would run longer)
    # What was charged: exactly what the client got, over the budget by less than one event.
    wait_for(lambda: fleet.show("cut")["scopes"]["*"]["tokens_used_today"] == usage.total_tokens, "settled", timeout=10)
    assert usage.total_tokens <= 500 + 4
    assert wait_for(lambda: fleet.aborted(), "the producer request aborted", timeout=10)
    assert fleet.counted("derender_quota_cuts_total", key="cut") == 1
    assert fleet.counted("derender_quota_tokens_total", key="cut", kind="completion") == usage.completion_tokens
    assert fleet.counted("derender_quota_tokens_total", key="cut", kind="prompt") == usage.prompt_tokens
    # The next request of the key is refused at once: nothing is left today.
    with pytest.raises(openai.RateLimitError) as caught:
        fleet.openai("cut").chat.completions.create(model="qwen3", messages=ask(), max_tokens=4)
    assert "tokens per day" in caught.value.body["message"]


def test_a_responses_stream_ends_at_the_budget_as_incomplete(fleet):
    """The Responses API's length cut: the response ends incomplete (max_output_tokens), its usage
    what was sent and charged."""
    events = list(fleet.openai("respcut").responses.create(model="qwen3", input=LONG, stream=True))
    final = events[-1]
    assert final.type == "response.incomplete", [e.type for e in events[-3:]]
    assert final.response.incomplete_details.reason == "max_output_tokens"
    usage = final.response.usage
    assert 500 - 4 <= usage.total_tokens <= 500 + 4
    wait_for(lambda: fleet.show("respcut")["scopes"]["*"]["tokens_used_today"] == usage.total_tokens, "settled", timeout=10)


def test_a_turn_after_a_stored_response_is_charged_its_whole_conversation(fleet):
    """``previous_response_id``: the turn's prompt is the stored conversation and its own input, all
    of it charged, as the usage the client read says."""
    client = fleet.openai("day")
    before = fleet.show("day")["scopes"]["*"]["tokens_used_today"]
    first = client.responses.create(model="qwen3", input="Name a colour.", max_output_tokens=40)
    second = client.responses.create(model="qwen3", input="And another.", previous_response_id=first.id,
                                     max_output_tokens=40)
    assert second.usage.input_tokens > first.usage.total_tokens  # the first turn is in its prompt
    spent = first.usage.total_tokens + second.usage.total_tokens
    wait_for(lambda: fleet.show("day")["scopes"]["*"]["tokens_used_today"] == before + spent,
             "settled to both turns' usage", timeout=10)


def test_reasoning_and_tool_calls_are_counted(qwen3_dir, redis_server, tmp_path_factory, qwen3_tokenizer):
    """A thinking model's reasoning and a tool call (parsed, Qwen3 + hermes) are completion tokens
    like any: chat streamed and Messages not, each settled to the usage its client read."""
    parsers = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    f = Fleet(qwen3_dir, redis_server, tmp_path_factory, filters=1, extra=parsers)
    try:
        script = f.path.parent / "script.jsonl"
        script.write_text(json.dumps({"token_ids": tool_call_answer(qwen3_tokenizer)}) + "\n")
        assert httpx.post(f.sim_url + "/sim/config", json={"mode": "script", "script": str(script)}).status_code == 200
        used = f.show("day")["scopes"]["*"]["tokens_used_today"]
        chunks = list(f.openai("day").chat.completions.create(
            model="qwen3", messages=ask(QUESTION), tools=[{"type": "function", "function": {
                k: v for k, v in WEATHER_FUNCTION.items() if k != "type"}}],
            stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert any(getattr(d, "reasoning", None) for d in deltas) and any(d.tool_calls for d in deltas)
        usage = chunks[-1].usage
        assert usage.completion_tokens == len(tool_call_answer(qwen3_tokenizer))
        used += usage.total_tokens
        wait_for(lambda: f.show("day")["scopes"]["*"]["tokens_used_today"] == used, "the chat stream settled", timeout=10)
        message = f.anthropic("day").messages.create(model="qwen3", max_tokens=200, messages=ask(QUESTION),
                                                     tools=[WEATHER_TOOL])
        assert [b.type for b in message.content] == ["thinking", "tool_use"]
        used += message.usage.input_tokens + message.usage.output_tokens
        wait_for(lambda: f.show("day")["scopes"]["*"]["tokens_used_today"] == used, "the message settled", timeout=10)
    finally:
        f.stop()


def test_n_choices_are_all_counted(fleet):
    before = fleet.show("day")["scopes"]["*"]["tokens_used_today"]
    answer = fleet.openai("day").chat.completions.create(model="qwen3", messages=ask("Say hi."), max_tokens=6, n=3)
    assert len(answer.choices) == 3
    assert answer.usage.completion_tokens > 6  # three choices' tokens
    wait_for(lambda: fleet.show("day")["scopes"]["*"]["tokens_used_today"] == before + answer.usage.total_tokens,
             "settled to the three choices' usage", timeout=10)


def test_a_messages_stream_ends_at_the_budget_with_max_tokens_as_its_stop_reason(qwen3_dir, redis_server, tmp_path_factory):
    """Messages always names max_tokens; with max_reservation the rest is charged as it streams, and
    the anthropic SDK reads the cut as a max_tokens stop, streamed and not."""
    f = Fleet(qwen3_dir, redis_server, tmp_path_factory, filters=1, max_reservation=16)
    try:
        client = f.anthropic("msgcut")
        with client.messages.stream(model="qwen3", max_tokens=2000, messages=ask(LONG)) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.stop_reason == "max_tokens"
        spent = final.usage.input_tokens + final.usage.output_tokens
        assert 500 - 4 <= spent <= 500 + 4
        wait_for(lambda: f.show("msgcut")["scopes"]["*"]["tokens_used_today"] == spent, "settled", timeout=10)
        # Metered, not streamed, within the budget: the answer of a key without limits (collected
        # from a producer stream against one JSON answer).
        (metered, streamed), (plain, buffered) = answer_json(f, "messages", "day"), answer_json(f, "messages", "free")
        assert streamed and not buffered
        assert metered == plain
        with pytest.raises(anthropic.RateLimitError):  # nothing left today
            client.messages.create(model="qwen3", max_tokens=100, messages=ask())
        # The counts are Redis's: a new filter process in the old one's place holds to them. The day's
        # counts stay as they were; qwen3's tokens per minute refill while the filter restarts, so
        # what remains of that window may only have grown back towards its limit.
        def counts() -> dict:
            return {name: (scope["tokens_used_today"], scope["tokens_used_this_month"], scope["tokens_remaining"])
                    for name, scope in f.show("msgcut")["scopes"].items()}

        shown = counts()
        f.restart()
        after = counts()
        assert {name: c[:2] for name, c in after.items()} == {name: c[:2] for name, c in shown.items()}
        assert after["*"][2] == shown["*"][2] == 0
        assert shown["qwen3"][2] <= after["qwen3"][2] <= 100_000
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.create(model="qwen3", max_tokens=100, messages=ask())
        assert "tokens per day" in refused.value.body["error"]["message"]
        # Not streamed: the producer streams to the filter, which ends the one answer at the budget.
        answer = f.anthropic("msgbuf").messages.create(model="qwen3", max_tokens=2000, messages=ask(LONG))
        assert answer.stop_reason == "max_tokens" and answer.content[0].text
        spent = answer.usage.input_tokens + answer.usage.output_tokens
        assert 500 - 4 <= spent <= 500 + 4
        wait_for(lambda: f.show("msgbuf")["scopes"]["*"]["tokens_used_today"] == spent, "settled", timeout=10)
    finally:
        f.stop()


def test_an_answer_not_streamed_ends_at_the_budget_as_a_length_cut(fleet):
    """A request not streamed that names no max_tokens may outrun its reservation: the producer
    streams it to the filter, which ends the one JSON answer at the budget (chat: finish_reason
    length; Responses: incomplete, max_output_tokens), charges what it holds and aborts the producer."""
    aborted = len(fleet.aborted())
    answer = fleet.openai("bufchat").chat.completions.create(model="qwen3", messages=ask(LONG))
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    assert 500 - 4 <= answer.usage.total_tokens <= 500 + 4
    assert answer.usage.prompt_tokens < 500 < answer.usage.prompt_tokens * 2  # the echo would run longer
    wait_for(lambda: fleet.show("bufchat")["scopes"]["*"]["tokens_used_today"] == answer.usage.total_tokens,
             "settled", timeout=10)
    assert wait_for(lambda: len(fleet.aborted()) > aborted, "the producer request aborted", timeout=10)
    response = fleet.openai("bufresp").responses.create(model="qwen3", input=LONG)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text
    assert 500 - 4 <= response.usage.total_tokens <= 500 + 4
    wait_for(lambda: fleet.show("bufresp")["scopes"]["*"]["tokens_used_today"] == response.usage.total_tokens,
             "settled", timeout=10)


def answer_json(fleet: Fleet, api: str, key: str) -> tuple[dict, bool]:
    """One answer not streamed, as JSON without what differs between two answers (ids, times), and
    whether the producer was asked for a stream."""
    if api == "messages":  # Messages always names max_tokens: more than a max_reservation of 16
        raw = fleet.anthropic(key).messages.with_raw_response.create(model="qwen3", max_tokens=300, messages=ask(LONG))
    elif api == "responses":
        raw = fleet.openai(key).responses.with_raw_response.create(model="qwen3", input="Say hello.", store=False)
    else:
        raw = fleet.openai(key).chat.completions.with_raw_response.create(model="qwen3", messages=ask("Say hello."))
    data = json.loads(raw.http_response.text)
    for field in ("id", "created", "created_at", "completed_at"):
        data.pop(field, None)
    for item in data.get("output") or ():
        item.pop("id", None)
    return data, httpx.get(fleet.sim_url + "/sim/requests").json()[-1]["stream"]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_answer_not_streamed_and_metered_is_the_answer_unmetered(fleet, api):
    """The producer streams a metered answer (no max_tokens) to the filter, which collects it: the
    client gets the same JSON as from the producer's one JSON answer (a key without limits)."""
    (metered, streamed), (plain, buffered) = answer_json(fleet, api, "day"), answer_json(fleet, api, "free")
    assert streamed and not buffered
    assert metered == plain


def test_two_filter_processes_never_let_one_key_past_its_budget(fleet):
    """Twelve streams of one key at once, half through each filter process: the day's 3000 tokens are
    never exceeded by more than one batch (4) per open stream, and the count is what the clients got."""
    results: list[int] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            chunks = list(fleet.openai("shared", i % 2).chat.completions.create(
                model="qwen3", messages=ask(LONG), stream=True, stream_options={"include_usage": True}))
            results.append(chunks[-1].usage.total_tokens)
        except openai.RateLimitError:
            results.append(0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sum(results) <= 3000 + 4 * 12
    wait_for(lambda: fleet.show("shared")["scopes"]["*"]["tokens_used_today"] == sum(results), "settled", timeout=10)
    assert sum(results) >= 3000 - 4 * 12  # the budget was spent, not refused early


# -- Redis away, reloads, the CLI --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["closed", "open"])
def test_redis_away_fails_as_the_file_says(qwen3_dir, tmp_path_factory, mode):
    gone = Redis()  # never started: its port refuses
    f = Fleet(qwen3_dir, gone, tmp_path_factory, filters=1, store=False, on_redis_error=mode)
    try:
        client = f.openai("day")
        if mode == "closed":
            with pytest.raises(openai.InternalServerError) as caught:
                client.chat.completions.create(model="qwen3", messages=ask(), max_tokens=4)
            assert caught.value.status_code == 503 and "quota store is unavailable" in caught.value.body["message"]
        else:
            answer = client.chat.completions.create(model="qwen3", messages=ask(), max_tokens=4)
            assert answer.choices[0].finish_reason
        assert "quota: Redis did not answer" in f.filters[0].tail(200), "the failure was not logged"
        assert f.counted("derender_quota_redis_errors_total", outcome=mode) >= 1
    finally:
        f.stop()


def test_a_reload_keeps_the_redis_client_or_closes_the_old_one_once_its_requests_settle(redis_server):
    """SIGHUP's new budgets (``Router.reload_quotas``): the same Redis keeps its one client; another
    Redis leaves the old client to the requests admitted on it, closed when the last has settled."""
    entry = {"keys": [{"name": "a", "key": "sk-a", "tokens_per_day": 1000}]}
    other = redis_server.url.rsplit("/", 1)[0] + "/1"

    async def run() -> None:
        first = quota.Quotas(quota.parse({"redis": redis_server.url, **entry}, "q.yaml"))
        account = quota.Account.of(first, {"authorization": "Bearer sk-a"})
        assert account is not None and await account.reserve(None, 10, 20) is None
        same = quota.Quotas(quota.parse({"redis": redis_server.url, **entry}, "q.yaml"))
        same.succeed(first)
        assert same.connection is first.connection and first.connection.client is not None
        moved = quota.Quotas(quota.parse({"redis": other, **entry}, "q.yaml"))
        moved.succeed(same)
        assert moved.connection is not first.connection
        assert first.connection.client is not None  # the admitted request has not settled yet
        await account.settle(5)
        assert first.connection.client is None
        assert (await quota.show(moved.config, "sk-a"))["scopes"]["*"]["tokens_used_today"] == 0  # another db
        assert (await quota.show(first.config, "sk-a"))["scopes"]["*"]["tokens_used_today"] == 15
        await moved.close()

    asyncio.run(run())


def test_sighup_reloads_the_file_without_dropping_streams(fleet):
    config = yaml.safe_load(fleet.path.read_text())
    hold = httpx.post(fleet.sim_url + "/sim/config", json={"delay": 0.02})
    assert hold.status_code == 200
    try:
        client = fleet.openai("free")
        stream = client.chat.completions.create(model="qwen3", messages=ask(LONG), stream=True)
        first = next(iter(stream))
        [entry] = [k for k in config["keys"] if k["name"] == "free"]
        entry["requests_per_minute"] = 1
        fleet.path.write_text(yaml.safe_dump(config))
        for flt in fleet.filters:
            flt.popen.send_signal(signal.SIGHUP)
        rest = list(stream)  # the open stream goes on to its end
        assert first and rest[-1].choices[0].finish_reason == "stop"
        wait_for(lambda: all("reloaded" in flt.tail(50) for flt in fleet.filters),
                 "both filters reloaded", timeout=10)
        answer = client.chat.completions.with_raw_response.create(model="qwen3", messages=ask(), max_tokens=4)
        assert answer.headers["x-ratelimit-limit-requests"] == "1"
    finally:
        httpx.post(fleet.sim_url + "/sim/config", json={"delay": 0})
        del entry["requests_per_minute"]
        fleet.path.write_text(yaml.safe_dump(config))
        for flt in fleet.filters:
            flt.popen.send_signal(signal.SIGHUP)


def test_quota_show_prints_what_remains(fleet):
    fleet.openai("day").chat.completions.create(model="qwen3", messages=ask(), max_tokens=4)
    result = subprocess.run([*DERENDER, "quota", "show", "day", "--quota-config", str(fleet.path)],
                            capture_output=True, text=True, timeout=120, check=True)
    shown = json.loads(result.stdout)
    scope = shown["scopes"]["*"]
    assert shown["key"] == "day" and scope["limits"] == {"tokens_per_day": 100_000}
    assert scope["tokens_used_today"] > 0 and scope["tokens_remaining"] == 100_000 - scope["tokens_used_today"]
    # By the secret too; the secret is never printed.
    by_secret = subprocess.run([*DERENDER, "quota", "show", KEYS["day"], "--quota-config", str(fleet.path)],
                               capture_output=True, text=True, timeout=120, check=True)
    assert KEYS["day"] not in by_secret.stdout and json.loads(by_secret.stdout)["key"] == "day"
