"""What a rendered request asks (``Asked``, as the stages read it) and the checks it passes before it
goes on to a producer, as a coupled vLLM makes them."""

from __future__ import annotations

from copy import copy

from ..exchange import Asked
from ..translate.errors import HTTPError
from ..translate.model import Model
from ..translate.render import Rendered

NAMED_MAX = frozenset(("max_tokens", "max_completion_tokens", "max_output_tokens"))  # a client's own cap
# OpenTelemetry's gen_ai.request.* attribute of each sampling field a request may set
SAMPLING = (
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("top_k", "gen_ai.request.top_k"),
    ("seed", "gen_ai.request.seed"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
)


def asked_of(rendered: Rendered) -> Asked:
    """What a rendered request asks, as the stages read it."""
    request, params = rendered.request, rendered.params
    sampling: dict[str, float] = {}
    given = vars(request)  # the fields as set (reading max_tokens through the model warns it is deprecated)
    for name, attribute in SAMPLING:
        value = given.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and attribute not in sampling:
            sampling[attribute] = value
    n = getattr(request, "n", None)
    if isinstance(n, int) and n != 1:
        sampling["gen_ai.request.choice.count"] = n
    model = getattr(request, "model", None)
    return Asked(
        model=model if isinstance(model, str) else None,
        stream=rendered.stream,
        n=getattr(params, "n", 1) or 1,
        max_tokens=getattr(params, "max_tokens", None),
        named_max=bool(NAMED_MAX & set(getattr(request, "model_fields_set", ()) or ())),
        sampling=sampling,
        images=len(rendered.media),
    )


def check_size(model: Model, body: bytes) -> None:
    """A rendered request larger than the producer body limit is a 413 here, in the client's shape,
    rather than Envoy's own reply once it overflows its buffer (images: their processed tensors
    travel in the body, 20-40x the size of the picture)."""
    if len(body) > model.max_producer_body:
        raise HTTPError(
            413,
            f"The request renders to {len(body)} bytes for the producer (its images' processed "
            f"tensors), more than this gateway sends ({model.max_producer_body} bytes, "
            "--max-producer-body-bytes). Send fewer or smaller images.",
        )


def verify_params(model: Model, rendered: object) -> None:
    """The engine's checks on sampling params (logprobs, logit_bias, stop and allowed token ids).

    A coupled vLLM makes them in its input processor before generating, so a bad request gets a
    400 rather than a 200 stream that ends in an error. Structured outputs and speculative decoding
    stay with the producer: it knows its backends.
    """
    params = getattr(rendered, "params", None)
    if params is not None:
        copy(params).verify(model.model_config, None, None, model.tokenizer)
