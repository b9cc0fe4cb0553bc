"""A vision-language model through the real Envoy: images rendered as vLLM renders them.

The filter serves a tiny Qwen2-VL (``assets.fetch("qwen2-vl")``: its config, its image processor's
config, the Qwen3 tokenizer). An image in a chat, Messages or Responses request reaches the producer
as ``GenerateRequest.features`` exactly as vLLM's own render tier writes them for the same request
(the oracle: vLLM's ``ServingRender`` in this process), and the simulator decodes them with vLLM's own
decoder, as a producer does. Bad images and forbidden URLs are 4xx in the client's own shape and
reach no producer; the filter fetches from no loopback, private or link-local address unless told.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from functools import partial
from http.server import HTTPServer, SimpleHTTPRequestHandler

import anthropic
import httpx
import openai
import orjson
import pytest
from PIL import Image
from stack import Stack

from derender.ops import assets

ALLOWED = "127.0.0.2"  # the one loopback address the stack may fetch media from (--allowed-media-networks)


def png(size: tuple[int, int] = (96, 64), seed: int = 1) -> bytes:
    image = Image.new("RGB", size, (seed * 40 % 256, 90, 200))
    image.putpixel((seed % size[0], 0), (0, 0, 0))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


class MediaServer:
    """A plain HTTP server on a loopback address serving one image; counts what it is asked."""

    def __init__(self, host: str, tmp_path) -> None:
        (tmp_path / "cat.png").write_bytes(png(seed=7))
        self.hits: list[str] = []
        hits = self.hits

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hits.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        self.server = HTTPServer((host, 0), partial(Handler, directory=str(tmp_path)))
        self.url = f"http://{host}:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def vl_dir() -> str:
    return str(assets.fetch("qwen2-vl"))


@pytest.fixture(scope="module")
def vl_stack(vl_dir):
    stack = Stack(vl_dir, ["--served-model-name", "vl", "--max-model-len", "8192", "--routing", "prefix",
                           "--allowed-media-networks", f"{ALLOWED}/32"]).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def oracle(vl_dir):
    """vLLM's own render tier for the same model and flags, in this process."""
    from derender.translate.model import Model, ModelSpec

    return Model(ModelSpec(model=vl_dir, served_model_name=("vl",), max_model_len=8192))


@pytest.fixture
def media(tmp_path_factory):
    allowed = MediaServer(ALLOWED, tmp_path_factory.mktemp("allowed"))
    forbidden = MediaServer("127.0.0.1", tmp_path_factory.mktemp("forbidden"))
    yield allowed, forbidden
    allowed.stop()
    forbidden.stop()


def vllm_render(oracle, body: dict) -> dict:
    """The GenerateRequest vLLM's ServingRender writes for ``body``."""
    from derender.translate.render import render_chat

    return orjson.loads(asyncio.run(render_chat(oracle, orjson.dumps(body), None)).body)


def decoded(features: dict) -> dict:
    """``features`` as a producer reads them (vLLM's decoder): per modality, each item's tensors by name
    (the byte order of a serialized item's fields is not part of the wire)."""
    from vllm.entrypoints.scale_out.token_in_token_out.mm_features import mm_kwargs_from_features
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import MultiModalFeatures

    items = mm_kwargs_from_features(MultiModalFeatures.model_validate(features))
    return {modality: [{key: (type(elem.field).__name__, elem.data.dtype, elem.data.tolist())
                        for key, elem in sorted(item.items())} for item in values]
            for modality, values in items.items()}


def same_features(sent: dict, expected: dict) -> bool:
    keep = ("mm_hashes", "mm_placeholders")
    return ({k: sent[k] for k in keep} == {k: expected[k] for k in keep}
            and decoded(sent) == decoded(expected))


def image_message(url: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_a_chat_image_reaches_the_producer_as_vllm_renders_it(vl_stack, oracle):
    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x")
    messages = image_message(data_url(png()))
    chunks = list(client.chat.completions.create(model="vl", messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    sent = vl_stack.sim_requests()[-1]
    expected = vllm_render(oracle, {"model": "vl", "messages": messages, "max_tokens": 8, "stream": True})
    assert sent["token_ids"] == expected["token_ids"]
    assert same_features(sent["features"], expected["features"])
    placeholder = sent["features"]["mm_placeholders"]["image"][0]
    assert placeholder["length"] > 1  # expanded in the prompt, as features require (content_parts would not be)
    assert set(sent["token_ids"][placeholder["offset"]:placeholder["offset"] + placeholder["length"]]) == {151655}
    assert chunks[-1].usage.prompt_tokens == len(expected["token_ids"])
    # Not streamed: the same prompt, the same features.
    answer = client.chat.completions.create(model="vl", messages=messages, max_tokens=8)
    assert same_features(vl_stack.sim_requests()[-1]["features"], expected["features"])
    assert answer.usage.prompt_tokens == len(expected["token_ids"])
    # A client asking vLLM's render options for no tensors still sends them: a producer would take an
    # item without them for one in its cache.
    client.chat.completions.create(model="vl", messages=messages, max_tokens=8, extra_body={"mm_payload": "none"})
    assert same_features(vl_stack.sim_requests()[-1]["features"], expected["features"])


def test_an_image_url_is_fetched_from_an_allowed_network(vl_stack, oracle, media):
    allowed, _ = media
    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x")
    messages = image_message(allowed.url + "/cat.png")
    client.chat.completions.create(model="vl", messages=messages, max_tokens=4)
    assert allowed.hits == ["/cat.png"]
    sent = vl_stack.sim_requests()[-1]
    expected = vllm_render(oracle, {"model": "vl", "messages": image_message(data_url(png(seed=7))),
                                    "max_tokens": 4})
    assert sent["features"]["mm_hashes"] == expected["features"]["mm_hashes"]  # the content's hash
    assert sent["token_ids"] == expected["token_ids"]


def test_messages_and_responses_images_reach_the_producer(vl_stack, oracle):
    raw = png(seed=3)
    expected = vllm_render(oracle, {"model": "vl", "messages": image_message(data_url(raw)), "max_tokens": 4})
    claude = anthropic.Anthropic(base_url=vl_stack.envoy_url, api_key="x")
    content = [{"type": "text", "text": "What is in the picture?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(raw).decode()}}]
    with claude.messages.stream(model="vl", max_tokens=4, messages=[{"role": "user", "content": content}]) as s:
        message = s.get_final_message()
    sent = vl_stack.sim_requests()[-1]
    assert sent["features"]["mm_hashes"] == expected["features"]["mm_hashes"]
    assert message.usage.input_tokens == len(sent["token_ids"])

    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x")
    for _ in range(2):  # the second time the picture is in vLLM's processor cache: still sent whole
        response = client.responses.create(model="vl", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is in the picture?"},
            {"type": "input_image", "image_url": data_url(raw), "detail": "auto"}]}])
        sent = vl_stack.sim_requests()[-1]
        assert same_features(sent["features"], expected["features"])
        assert response.usage.input_tokens == len(sent["token_ids"])


NOT_AN_IMAGE = data_url(b"this is text, not a picture")
TRUNCATED = data_url(png()[:60])


@pytest.mark.parametrize("url, why", [(NOT_AN_IMAGE, "not an image"), (TRUNCATED, "truncated"),
                                      ("file:///etc/passwd", "a local file"),
                                      ("http://169.254.169.254/latest/meta-data", "link-local")])
def test_a_bad_image_is_a_400_and_reaches_no_producer(vl_stack, url, why):
    before = vl_stack.sim_received()
    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="vl", messages=image_message(url), max_tokens=4)
    assert info.value.body["type"] == "BadRequestError", why
    claude = anthropic.Anthropic(base_url=vl_stack.envoy_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(model="vl", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}]}])
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "invalid_request_error"
    assert vl_stack.sim_received() == before


def test_loopback_and_private_addresses_are_not_fetched(vl_stack, media):
    """The filter must not be a way into the network it runs in: a loopback URL (as a name that resolves
    there, or a literal) is refused before any connection, nothing reaches the server or a producer."""
    _, forbidden = media
    before = vl_stack.sim_received()
    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x", max_retries=0)
    port = forbidden.url.rsplit(":", 1)[1]
    for url in (forbidden.url + "/cat.png", f"http://localhost:{port}/cat.png", f"http://[::1]:{port}/cat.png",
                "http://10.0.0.1/cat.png", "http://192.168.1.1/cat.png"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="vl", messages=image_message(url), max_tokens=4)
        assert "does not fetch from" in info.value.body["message"], url
    assert forbidden.hits == [] and vl_stack.sim_received() == before


def test_a_text_model_still_refuses_images(plain_stack):
    client = openai.OpenAI(base_url=plain_stack.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="qwen3", messages=image_message(data_url(png())))
    assert "is not a multimodal model" in info.value.body["message"]


def test_models_lists_the_vlm(vl_stack):
    assert [c["id"] for c in httpx.get(vl_stack.base_url + "/models", timeout=30).json()["data"]] == ["vl"]


def test_an_image_too_large_for_the_producer_is_a_413_in_the_clients_shape(vl_stack):
    """A 2048x2048 picture is ~60 KB as a plain JPEG and 33 MB of processed tensors in the producer's
    request: more than Envoy's buffer holds. The filter says so, in each API's shape; nothing is sent."""
    image = Image.linear_gradient("L").resize((2048, 2048)).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, "JPEG")
    url = data_url(buf.getvalue(), "image/jpeg")
    before = vl_stack.sim_received()
    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="vl", messages=image_message(url), max_tokens=4)
    assert info.value.status_code == 413 and info.value.body["type"] == "RequestEntityTooLarge"
    assert "--max-producer-body-bytes" in info.value.body["message"]
    claude = anthropic.Anthropic(base_url=vl_stack.envoy_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as error:
        claude.messages.create(model="vl", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": url.split(",", 1)[1]}}]}])
    assert error.value.status_code == 413 and error.value.body["error"]["type"] == "request_too_large"
    assert vl_stack.sim_received() == before


def test_the_routing_key_follows_the_image(vl_stack, oracle):
    """Prefix routing keys a prompt with its images as vLLM's block hashes carry them: the same text with
    another picture is another key (no cache to share), the same picture the same key."""
    from derender.routing.prefix import BlockHasher, PrefixKey, answer_marker
    from derender.translate.render import render_chat

    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x")
    keys = []
    for seed in (11, 11, 12):
        client.chat.completions.create(model="vl", messages=image_message(data_url(png(seed=seed))), max_tokens=2)
        keys.append(vl_stack.sim_headers()[-1]["x-derender-prefix-key"])
    assert keys[0] == keys[1] != keys[2]
    body = {"model": "vl", "messages": image_message(data_url(png(seed=12))), "max_tokens": 2}
    rendered = asyncio.run(render_chat(oracle, orjson.dumps(body), None))
    assert rendered.media and rendered.media[0][0] == vl_stack.sim_requests()[-1]["features"]["mm_hashes"]["image"][0]
    key = PrefixKey(BlockHasher(16), answer_marker(oracle.tokenizer), 256)
    assert key.key(rendered.prompt_token_ids, media=rendered.media)[0] == keys[2]
    assert key.key(rendered.prompt_token_ids)[0] != keys[2]


def test_a_bad_image_in_a_responses_request_is_a_400(vl_stack):
    before = vl_stack.sim_received()
    client = openai.OpenAI(base_url=vl_stack.base_url, api_key="x", max_retries=0)
    for url in (NOT_AN_IMAGE, "http://127.0.0.1:9/cat.png"):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="vl", max_output_tokens=4, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": url, "detail": "auto"}]}])
    assert vl_stack.sim_received() == before


def test_config_takes_the_media_options_per_model(tmp_path, vl_dir):
    """``--config`` entries take vLLM's media options as ``vllm serve`` flags do; ``serve`` adds the networks."""
    import json as jsonlib

    from derender.routing import config

    media = tmp_path / "media"
    media.mkdir()
    path = tmp_path / "models.yaml"
    path.write_text(jsonlib.dumps({"models": [{"name": "vl", "model": vl_dir, "producer": {"cluster": "c", "url": "http://p"},
                                               "allowed_local_media_path": "media",
                                               "allowed_media_domains": ["images.example"],
                                               "mm_processor_cache_gb": 1}]}))
    [entry] = config.load(str(path))
    argv = entry.spec.vllm_argv()
    assert argv[argv.index("--allowed-local-media-path") + 1] == str(media)
    assert argv[argv.index("--allowed-media-domains") + 1] == "images.example"
    assert argv[argv.index("--mm-processor-cache-gb") + 1] == "1.0"
    path.write_text(jsonlib.dumps({"models": [{"name": "vl", "model": vl_dir, "producer": {"cluster": "c", "url": "http://p"},
                                               "mm_processor_cache_gb": "lots"}]}))
    with pytest.raises(config.ConfigError, match="mm_processor_cache_gb"):
        config.load(str(path))


def test_sparse_placeholders_are_refused_with_a_reason(oracle):
    """A model whose placeholders are sparse (only some tokens take the embeddings: Gemma 3, Pixtral-style
    LLaVA) cannot be carried exactly by the generate wire (offset and length only): the filter's feature
    extraction refuses such a prompt, which vLLM's error handling makes a 400; dense ones pass."""
    import torch
    from vllm.multimodal.inputs import PlaceholderRange

    from derender.translate.errors import from_exception
    from derender.translate.vision import check_dense

    dense = {"mm_placeholders": {"image": [PlaceholderRange(offset=4, length=8),
                                           PlaceholderRange(offset=20, length=3, is_embed=torch.ones(3, dtype=torch.bool))]}}
    check_dense(dense)
    sparse = {"mm_placeholders": {"image": [PlaceholderRange(offset=4, length=4,
                                                             is_embed=torch.tensor([False, True, True, False]))]}}
    with pytest.raises(Exception) as info:
        oracle.serving_render._extract_mm_features(sparse)
    error = from_exception(info.value)
    assert error.status == 400 and "sparse placeholders" in str(error)
