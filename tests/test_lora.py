"""LoRA adapters, as ``vllm serve --lora-modules`` serves them, through the real Envoy.

The filter takes ``--lora-modules`` as vLLM takes it (``name=path`` and the JSON form): vLLM's own
``OpenAIServingModels`` holds the adapters, so ``/v1/models`` lists them with their ``parent`` as vLLM's
cards do, the model check accepts their names, and a request naming one goes to the producer with
``GenerateRequest.model`` set to it (what selects the adapter there, ``serve_tokens``). An unknown
name is vLLM's 404, sent nowhere. The producer here is the simulator; the adapters' weights are the
producers' to load.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from stack import Stack

from derender.routing import config

LORAS = ["my-lora=/adapters/my-lora", json.dumps({"name": "tuned", "path": "/adapters/tuned", "base_model_name": "qwen3"})]


@pytest.fixture(scope="module")
def lora_stack(qwen3_dir):
    stack = Stack(qwen3_dir, ["--served-model-name", "qwen3", "qwen3-alias", "--max-model-len", "4096",
                              "--lora-modules", *LORAS]).start()
    yield stack
    stack.stop()


def vllm_cards(qwen3_dir) -> list[dict]:
    """What vLLM's own OpenAIServingModels lists for the same flags (its render-free registry + adapters)."""
    import asyncio

    from derender.translate.model import Model, ModelSpec

    model = Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3", "qwen3-alias"), max_model_len=4096,
                            lora_modules=tuple(LORAS)))
    return asyncio.run(model.registry.show_available_models()).model_dump()["data"]


def test_models_lists_the_adapters_as_vllm_does(lora_stack, qwen3_dir):
    got = httpx.get(lora_stack.base_url + "/models", timeout=30).json()["data"]
    keep = ("id", "object", "owned_by", "root", "parent", "max_model_len")
    assert [{k: c[k] for k in keep} for c in got] == [{k: c[k] for k in keep} for c in vllm_cards(qwen3_dir)]
    assert [(c["id"], c["parent"], c["root"]) for c in got] == [
        ("qwen3", None, qwen3_dir), ("qwen3-alias", None, qwen3_dir), ("my-lora", "qwen3", "/adapters/my-lora"),
        ("tuned", "qwen3", "/adapters/tuned")]
    client = openai.OpenAI(base_url=lora_stack.base_url, api_key="x")
    assert client.models.retrieve("tuned").model_extra["parent"] == "qwen3"


@pytest.mark.parametrize("name, answered", [("my-lora", "my-lora"), ("tuned", "tuned"), ("qwen3", "qwen3"),
                                            ("qwen3-alias", "qwen3")])
def test_a_request_naming_an_adapter_selects_it_at_the_producer(lora_stack, name, answered):
    """The producer gets the name asked for; the answer names what vLLM's ``models.model_name``
    does: the adapter, else the first served name (an alias is answered as the model)."""
    client = openai.OpenAI(base_url=lora_stack.base_url, api_key="x")
    messages = [{"role": "user", "content": "Say hi"}]
    chunks = list(client.chat.completions.create(model=name, messages=messages, stream=True))
    assert chunks[0].model == answered and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Say hi"
    assert lora_stack.sim_requests()[-1]["model"] == name
    assert client.completions.create(model=name, prompt="Say hi", max_tokens=5).model == answered
    assert lora_stack.sim_requests()[-1]["model"] == name
    claude = anthropic.Anthropic(base_url=lora_stack.envoy_url, api_key="x")
    assert claude.messages.create(model=name, max_tokens=20, messages=messages).model == answered
    assert lora_stack.sim_requests()[-1]["model"] == name
    assert client.responses.create(model=name, input="Say hi").model == answered
    assert lora_stack.sim_requests()[-1]["model"] == name


def test_an_unknown_adapter_is_vllms_404_and_reaches_no_producer(lora_stack):
    before = len(lora_stack.sim_requests())
    client = openai.OpenAI(base_url=lora_stack.base_url, api_key="x")
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-lora", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["message"] == "The model `no-such-lora` does not exist. Valid aliases: qwen3, qwen3-alias."
    assert len(lora_stack.sim_requests()) == before


def test_config_takes_lora_modules_per_model(tmp_path, qwen3_dir):
    path = tmp_path / "models.yaml"
    item = {"name": "q", "model": qwen3_dir, "producer": {"cluster": "c", "url": "http://p"},
            "lora_modules": ["a=/adapters/a", {"name": "b", "path": "/adapters/b"}]}
    path.write_text(json.dumps({"models": [item]}))
    [entry] = config.load(path)
    assert entry.spec.lora_modules == ("a=/adapters/a", '{"name": "b", "path": "/adapters/b"}')
    assert entry.spec.vllm_argv()[-3:] == ["--lora-modules", *entry.spec.lora_modules]
    path.write_text(json.dumps({"models": [{**item, "lora_modules": "a=/x"}]}))
    with pytest.raises(config.ConfigError, match="lora_modules must be a list"):
        config.load(path)


def test_an_adapter_named_like_another_model_is_refused(qwen3_dir):
    from derender.endpoints.router import Backend, Router
    from derender.routing.producer import Producer
    from derender.translate.model import Model, ModelSpec

    a = Model(ModelSpec(model=qwen3_dir, served_model_name=("a",), lora_modules=("b=/adapters/b",)))
    b = Model(ModelSpec(model=qwen3_dir, served_model_name=("b",)))
    producer = Producer("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="'b' is served twice"):
        Router([Backend.local(a, producer), Backend.local(b, producer, "other")])


def test_the_adapter_reaches_the_prefix_key(qwen3_dir):
    """Prefix routing keys an adapter's prompt with the adapter (name and path), as vLLM's block hashes
    include it: the request's rewrite carries it to the balancer (tests/test_prefix_key.py checks the hashes)."""
    import asyncio

    from derender.endpoints.chat import ChatExchange
    from derender.translate.model import Model, ModelSpec

    model = Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3", "qwen3-alias"), lora_modules=tuple(LORAS)))
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    for name, lora in [("tuned", ("tuned", "/adapters/tuned")), ("my-lora", ("my-lora", "/adapters/my-lora")),
                       ("qwen3", None), ("qwen3-alias", None)]:
        rewrite = asyncio.run(ChatExchange(model, None, None).request_body(json.dumps({"model": name, **body}).encode()))
        assert rewrite.lora == lora, name
