"""Several models behind one Envoy: ``derender up --config FILE``, run as a user runs it.

Two models with different tokenizers and parsers (Qwen3 with ``qwen3`` + ``hermes``
under two names, DeepSeek-R1 with ``deepseek_r1``), loaded in one filter process, each
with its own producer cluster (one simulator each, in echo mode). The filter reads the
body's ``model`` and sets ``x-derender-cluster``; Envoy's route sends the request to
that cluster. Each simulator records what it got, so the routing is seen from the
producers' side.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from derender.routing import config
from derender.routing.balance import ENDPOINT_KEY, ENDPOINT_NAMESPACE
from derender.ops import envoy_config
from openai import OpenAI
from stack import LOGS, free_port, http_get, start_sim, wait_for

BIN = Path(sys.executable).parent
MESSAGE = "Routing check: 🤖 héllo, 世界"
# transformers 5.20 loads this DeepSeek tokenizer.json with a Metaspace pre-tokenizer (its
# "incorrect regex pattern" fix-up), so vLLM drops spaces and non-ASCII text of R1 prompts in
# this venv. Routing does not depend on it: R1 gets a message that tokenizes the same either way.
R1_MESSAGE = "RoutingCheck:ok!"


class Fleet:
    def __init__(self, qwen3_dir: str, deepseek_dir: str, folder: Path) -> None:
        self.procs = []
        try:
            self._start(qwen3_dir, deepseek_dir, folder)
        except BaseException:
            self.stop()
            raise

    def _start(self, qwen3_dir: str, deepseek_dir: str, folder: Path) -> None:
        self.qwen3_urls = []
        for _ in range(2):  # one cluster, two producers: Envoy balances and says which it reached
            sim, url = start_sim(qwen3_dir)
            self.procs.append(sim)
            self.qwen3_urls.append(url)
        sim, self.r1_url = start_sim(deepseek_dir)
        self.procs.append(sim)
        self.r1_urls = [self.r1_url]
        self.config = folder / "models.yaml"
        self.config.write_text(yaml.safe_dump({"models": [
            {"name": ["qwen3", "qwen3-alias"], "model": qwen3_dir, "max_model_len": 4096, "reasoning_parser": "qwen3",
             "tool_call_parser": "hermes", "enable_auto_tool_choice": True,
             "default_chat_template_kwargs": {"enable_thinking": False},
             "producer": {"cluster": "qwen3-producers", "url": self.qwen3_urls}},
            {"name": "r1", "model": os.path.relpath(deepseek_dir, folder), "max_model_len": 8192,
             "reasoning_parser": "deepseek_r1", "producer": {"cluster": "r1-producers", "url": self.r1_url}},
        ]}))
        self.port = free_port()
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log = open(LOGS / f"up-multi-{os.getpid()}.log", "w+")
        self.up = subprocess.Popen(
            [str(BIN / "derender"), "up", "--config", str(self.config), "--port", str(self.port), "--workers", "1"],
            stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True,
        )
        ready = self.up.stdout.readline()
        if f"http://127.0.0.1:{self.port}/v1" not in ready:
            self.log.seek(0)
            raise RuntimeError(f"derender up --config did not start: {ready!r}\n{self.log.read()[-3000:]}")
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60)

    def requests(self, *urls: str) -> list[dict]:
        """What these producers got, all of them."""
        return [r for url in urls for r in json.loads(http_get(url + "/sim/requests")[1])]

    def stop(self) -> None:
        up = getattr(self, "up", None)
        if up is not None and up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
        for proc in self.procs:
            proc.stop()
        if hasattr(self, "log"):
            self.log.close()


@pytest.fixture(scope="module")
def fleet(qwen3_dir, deepseek_dir, tmp_path_factory):
    f = Fleet(qwen3_dir, deepseek_dir, tmp_path_factory.mktemp("multi"))
    yield f
    f.stop()


@pytest.fixture(scope="module")
def deepseek_tokenizer(deepseek_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{deepseek_dir}/tokenizer.json")


def chat(fleet: Fleet, model: str, message: str, **kw) -> str:
    """The whole answer (content, or reasoning where the model's parser calls it that)."""
    r = fleet.client.chat.completions.create(model=model, messages=[{"role": "user", "content": message}], **kw)
    message = r.choices[0].message
    return (message.content or "") + (getattr(message, "reasoning", None) or "")


@pytest.mark.parametrize(
    "model, own, other, turn",
    [
        ("qwen3", "qwen3_urls", "r1_urls", "<|im_start|>user\n"),
        ("qwen3-alias", "qwen3_urls", "r1_urls", "<|im_start|>user\n"),
        ("r1", "r1_urls", "qwen3_urls", "<｜User｜>"),
    ],
)
def test_each_model_reaches_its_own_producer(fleet, qwen3_tokenizer, deepseek_tokenizer, model, own, other, turn):
    own_urls, other_urls = getattr(fleet, own), getattr(fleet, other)
    before_own = {url: len(fleet.requests(url)) for url in own_urls}
    before_other = len(fleet.requests(*other_urls))
    message = R1_MESSAGE if model == "r1" else MESSAGE
    text = chat(fleet, model, message)
    assert len(fleet.requests(*other_urls)) == before_other
    got = [url for url in own_urls if len(fleet.requests(url)) == before_own[url] + 1]
    assert len(got) == 1 and sum(len(fleet.requests(url)) for url in own_urls) == sum(before_own.values()) + 1
    tokenizer = deepseek_tokenizer if model == "r1" else qwen3_tokenizer
    prompt = tokenizer.decode(fleet.requests(got[0])[-1]["token_ids"], skip_special_tokens=False)
    assert turn + message in prompt  # rendered with this model's own chat template
    assert text.strip() == message


def test_streaming_and_completions_are_routed(fleet, deepseek_tokenizer):
    before = len(fleet.requests(fleet.r1_url))
    chunks = list(fleet.client.chat.completions.create(
        model="r1", messages=[{"role": "user", "content": R1_MESSAGE}], stream=True))
    text = "".join((c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning", None) or "")
                   for c in chunks if c.choices)
    assert text.strip() == R1_MESSAGE
    completion = fleet.client.completions.create(model="r1", prompt=f"<｜User｜>{R1_MESSAGE}<｜Assistant｜>", max_tokens=50)
    assert completion.choices[0].text == R1_MESSAGE
    assert len(fleet.requests(fleet.r1_url)) == before + 2


def test_request_without_a_model_goes_to_the_first(fleet):
    before = len(fleet.requests(*fleet.qwen3_urls))
    r = httpx.post(fleet.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(fleet.requests(*fleet.qwen3_urls)) == before + 1


def test_the_client_cannot_pick_the_cluster(fleet):
    before = len(fleet.requests(fleet.r1_url))
    r = httpx.post(fleet.base + "/v1/chat/completions", headers={"x-derender-cluster": "r1-producers"},
                   json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(fleet.requests(fleet.r1_url)) == before


def test_unknown_model_is_vllms_404(fleet):
    before = [len(fleet.requests(u)) for u in (*fleet.qwen3_urls, fleet.r1_url)]
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"})]:
        r = httpx.post(fleet.base + path, json={"model": "gpt-4", **body}, timeout=60)
        assert r.status_code == 404
        error = r.json()["error"]
        # BaseServing._check_model's wording, with every served name as a valid alias.
        assert error == {"message": "The model `gpt-4` does not exist. Valid aliases: qwen3, qwen3-alias, r1.",
                         "type": "NotFoundError", "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError):
        fleet.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    # Messages clients read Anthropic's shape, as vLLM's Messages route translates its ErrorResponse.
    r = httpx.post(fleet.base + "/v1/messages", timeout=60,
                   json={"model": "gpt-4", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message":
                        "The model `gpt-4` does not exist. Valid aliases: qwen3, qwen3-alias, r1."}}
    assert [len(fleet.requests(u)) for u in (*fleet.qwen3_urls, fleet.r1_url)] == before


def test_client_disconnect_aborts_on_the_producer_that_runs_the_request(fleet):
    """Envoy balances over the cluster's producers and names the one it reached: the abort goes there only."""
    received = lambda url: json.loads(http_get(url + "/sim/stats")[1])["received"]
    for url in fleet.qwen3_urls:
        assert httpx.post(url + "/sim/config", json={"delay": 0.02}, timeout=10).status_code == 200
    try:
        before = {url: received(url) for url in fleet.qwen3_urls}
        body = {"model": "qwen3", "messages": [{"role": "user", "content": "word " * 300}], "stream": True}
        with httpx.stream("POST", fleet.base + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        engine_id = "generate-tokens-" + first["id"].removeprefix("chatcmpl-")
        aborted = lambda url: engine_id in json.loads(http_get(url + "/sim/aborted")[1])
        served = [url for url in fleet.qwen3_urls if received(url) > before[url]]
        assert len(served) == 1, served
        wait_for(lambda: aborted(served[0]), "the abort at the qwen3 producer that runs the request", timeout=10)
        assert not any(aborted(u) for u in (*fleet.qwen3_urls, fleet.r1_url) if u != served[0])
    finally:
        for url in fleet.qwen3_urls:
            httpx.post(url + "/sim/config", json={"delay": 0.0}, timeout=10)


def test_models_lists_every_model(fleet):
    assert [m.id for m in fleet.client.models.list().data] == ["qwen3", "qwen3-alias", "r1"]
    r1 = fleet.client.models.retrieve("r1")
    assert r1.id == "r1" and r1.owned_by == "vllm" and r1.model_extra["max_model_len"] == 8192
    assert fleet.client.models.retrieve("qwen3").model_extra["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError) as info:
        fleet.client.models.retrieve("gpt-4")
    assert info.value.body["param"] == "model" and "Valid aliases: qwen3, qwen3-alias, r1." in info.value.body["message"]


def test_tokenize_uses_each_models_tokenizer(fleet, qwen3_tokenizer, deepseek_tokenizer):
    for model, tokenizer in (("qwen3", qwen3_tokenizer), ("r1", deepseek_tokenizer)):
        r = httpx.post(fleet.base + "/tokenize", json={"model": model, "prompt": R1_MESSAGE, "add_special_tokens": False}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tokenizer.encode(R1_MESSAGE, add_special_tokens=False).ids
        d = httpx.post(fleet.base + "/detokenize", json={"model": model, "tokens": r.json()["tokens"]}, timeout=30)
        assert d.json()["prompt"] == R1_MESSAGE
    assert qwen3_tokenizer.encode(R1_MESSAGE).ids != deepseek_tokenizer.encode(R1_MESSAGE, add_special_tokens=False).ids


# -- the template and the file -----------------------------------------------------------------------
def test_multi_template_is_local_with_a_cluster_header_route():
    """envoy/multi.yaml must stay envoy/local.yaml but for the route and the producer clusters."""
    entries = [config.ModelEntry(("a",), None, "a-cluster", ("http://127.0.0.1:1",), "http://render"),
               config.ModelEntry(("b",), None, "b-cluster", ("http://10.0.0.1:2", "http://10.0.0.2:2"), "http://render")]
    local = yaml.safe_load(envoy_config.render("local.yaml"))
    multi = yaml.safe_load(envoy_config.render("multi.yaml", PRODUCER_CLUSTERS=config.envoy_clusters(entries)))

    def route(cfg):
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]

    assert route(local).pop("cluster") == "producer"
    assert route(multi).pop("cluster_header") == "x-derender-cluster"
    clusters = multi["static_resources"]["clusters"]
    assert [c["name"] for c in clusters] == ["derender", "a-cluster", "b-cluster"]
    endpoints = clusters[2]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"] for e in endpoints] == [
        {"address": "10.0.0.1", "port_value": 2}, {"address": "10.0.0.2", "port_value": 2}]
    local["static_resources"]["clusters"] = [c for c in local["static_resources"]["clusters"] if c["name"] != "producer"]
    multi["static_resources"]["clusters"] = clusters[:1]
    assert multi == local


def _write(tmp_path: Path, models) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


@pytest.mark.parametrize(
    "models, words",
    [
        ([], "at least one entry"),
        ([{"name": "a", "render_url": "http://r", "producer": {"cluster": "c", "url": "http://p"}, "tools": 1}], "unknown keys"),
        ([{"name": "a", "render_url": "http://r"}], "'producer' must be"),
        ([{"name": "a", "render_url": "http://r", "producer": {"cluster": "derender", "url": "http://p"}}], "producer.cluster"),
        ([{"name": "a", "producer": {"cluster": "c", "url": "http://p"}}], "'model' (the tokenizer folder) is required"),
        ([{"name": "a", "model": "no-such-folder", "producer": {"cluster": "c", "url": "http://p"}}], "does not exist"),
        ([{"name": "a", "render_url": "http://r", "producer": {"cluster": "c", "url": "http://p"}},
          {"name": ["b", "a"], "render_url": "http://r", "producer": {"cluster": "d", "url": "http://q"}}], "model name 'a'"),
        ([{"name": "a", "render_url": "http://r", "producer": {"cluster": "c", "url": "http://p"}},
          {"name": "b", "render_url": "http://r", "producer": {"cluster": "c", "url": "http://q"}}], "different URLs"),
        ([{"name": "a", "render_url": "http://r", "producer": {"cluster": "c", "url": "http://p"}, "routing": "sticky"}],
         "routing must be one of"),
        ([{"name": "a", "render_url": "http://r", "producer": {"cluster": "c", "url": "http://p"}, "routing": "prefix"},
          {"name": "b", "render_url": "http://r", "producer": {"cluster": "c", "url": "http://p"}}], "different routing"),
    ],
    ids=["empty", "unknown-key", "no-producer", "reserved-cluster", "no-model", "missing-folder", "duplicate-name", "cluster-urls",
         "bad-routing", "cluster-routing"],
)
def test_config_errors_say_where(tmp_path, models, words):
    with pytest.raises(config.ConfigError) as info:
        config.load(_write(tmp_path, models))
    assert words in str(info.value) and str(tmp_path) in str(info.value)


def test_config_entries(tmp_path, qwen3_dir):
    path = _write(tmp_path, [
        {"name": "q", "model": qwen3_dir, "max_model_len": 2048, "reasoning_parser": "qwen3",
         "default_chat_template_kwargs": {"enable_thinking": False}, "producer": {"cluster": "q", "url": ["http://a:1", "http://b:2"]}},
        {"name": ["t", "t2"], "render_url": "http://render:8000", "producer": {"cluster": "t", "url": "http://c:3"}},
    ])
    q, t = config.load(path)
    assert q.names == ("q",) and q.spec.max_model_len == 2048 and q.spec.reasoning_parser == "qwen3"
    assert json.loads(q.spec.default_chat_template_kwargs) == {"enable_thinking": False}
    assert q.producer_urls == ("http://a:1", "http://b:2") and q.producer_url == "http://a:1"
    assert t.spec is None and t.render_url == "http://render:8000" and t.names == ("t", "t2")


def test_config_routing_writes_each_cluster_to_match(tmp_path):
    """An entry's ``routing`` (else --routing) decides how its Envoy cluster balances."""
    path = _write(tmp_path, [
        {"name": "a", "render_url": "http://r", "producer": {"cluster": "a", "url": ["http://a:1", "http://a:2"]},
         "routing": "precise"},
        {"name": "b", "render_url": "http://r", "producer": {"cluster": "b", "url": ["http://b:1", "http://b:2"]}},
    ])
    entries = config.load(path)
    assert [e.routing for e in entries] == ["precise", None]
    clusters = {c["name"]: c for c in (json.loads(line[4:]) for line in config.envoy_clusters(entries, "prefix").splitlines())}
    policy = clusters["a"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    # The chosen replica comes as dynamic metadata (which a client cannot send), not as a header.
    assert policy["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": ENDPOINT_NAMESPACE, "path": [{"key": ENDPOINT_KEY}]}}]
    assert clusters["b"]["lb_policy"] == "RING_HASH"
    assert clusters["b"]["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 125
    for cluster in clusters.values():  # several replicas: health-checked, so a dead one leaves the ring
        assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
    least = json.loads(config.envoy_clusters(entries[1:]).splitlines()[0][4:])
    assert least["lb_policy"] == "LEAST_REQUEST"


def test_serve_refuses_model_flags_with_a_config(tmp_path):
    r = subprocess.run([str(BIN / "derender"), "serve", "--config", str(tmp_path / "x.yaml"), "--model", "m"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "--config lists the models: drop --model" in r.stderr


def test_config_stream_interval_per_model(tmp_path, qwen3_dir):
    """``stream_interval`` per model, as ``--stream-interval``: given to vLLM's own arguments (its
    bounds), refused in the file when it is not a positive integer."""
    producer = {"cluster": "c", "url": "http://p"}
    [entry] = config.load(_write(tmp_path, [{"name": "q", "model": qwen3_dir, "producer": producer, "stream_interval": 4}]))
    assert entry.spec.stream_interval == 4 and entry.spec.vllm_argv()[-2:] == ["--stream-interval", "4"]
    for bad in (0, "4", True):
        with pytest.raises(config.ConfigError) as info:
            config.load(_write(tmp_path, [{"name": "q", "model": qwen3_dir, "producer": producer, "stream_interval": bad}]))
        assert "stream_interval must be a positive integer" in str(info.value)
