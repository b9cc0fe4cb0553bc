"""What a vision-language model needs in the filter before vLLM builds its renderer.

vLLM renders an image as its coupled server does (``ServingRender`` fills
``GenerateRequest.features``: the processed tensors, content hashes and
placeholder ranges), so the filter needs no weights: config.json,
preprocessor_config.json, the tokenizer and a chat template. Two things stand
in the way, both mended here once per process:

- vLLM's VLM model files import transformers' torchvision-based image
  processors, and PyPI's torchvision (a CUDA build) does not import beside the
  CPU torch as it is: ``derender.torchvision_ops`` (run in every process of the
  virtualenv by set-up's ``.pth`` file, and here again in case it was not).
- vLLM inspects a model class in a child Python process (another torch start,
  seconds). The architecture is loaded and registered in this process instead
  (vLLM's ``_RegisteredModel``), as ``ModelRegistry.register_model`` does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from . import vllm_seams

log = logging.getLogger("derender.vision")


def is_vision_config(model: str) -> bool:
    """A local model folder whose config.json describes a vision tower."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config


def ensure_torchvision() -> None:
    """Import torchvision, its compiled operators declared first if they cannot load."""
    from . import torchvision_ops

    torchvision_ops.install()
    import torchvision

    if torchvision_ops.declared:
        log.info(
            "torchvision %s without its compiled ops (a CUDA build beside CPU torch): transforms only",
            torchvision.__version__,
        )


def register_in_process(model: str) -> None:
    """Load the model folder's architectures in this process so vLLM inspects them here."""
    config = json.loads((Path(model) / "config.json").read_text())
    for arch in config.get("architectures") or ():
        vllm_seams.register_in_process(arch)


def check_dense(engine_input: Any) -> None:
    """Refuse a rendered prompt whose image placeholders are sparse (``PlaceholderRange.is_embed``: only
    some of the placeholder tokens take the image's embeddings, as in Gemma 3 or Pixtral-style LLaVA).
    The generate wire carries each placeholder's offset and length only, so a producer would embed
    every token of the range: a wrong answer, not an error. A 400 says why instead."""
    from vllm.exceptions import VLLMValidationError

    for modality, ranges in (engine_input.get("mm_placeholders") or {}).items():
        for placeholder in ranges:
            mask = placeholder.is_embed
            if mask is not None and not bool(mask.all()):
                raise VLLMValidationError(
                    f"This model marks only some of an {modality} item's placeholder tokens as embeddings "
                    "(sparse placeholders); vLLM's generate wire carries a placeholder's offset and length "
                    f"only, so disaggregated serving cannot send this {modality} to a producer exactly.",
                    parameter=f"{modality}_url",
                )


def guard_features(serving_render: Any) -> None:
    """Every feature extraction of ``serving_render`` (vLLM's ``ServingRender``, which every endpoint's
    image path goes through) refuses sparse placeholders first (``check_dense``)."""

    def guarded(extract: Any) -> Any:
        def checked(engine_input: Any, **kwargs: Any) -> Any:
            check_dense(engine_input)
            return extract(engine_input, **kwargs)

        return checked

    vllm_seams.wrap_mm_features(serving_render, guarded)


def prepare(model: str) -> bool:
    """Ready this process for ``model`` if it is a vision-language model folder; says whether it is.
    Call it before vLLM or transformers is imported."""
    from . import torchvision_ops

    torchvision_ops.install()
    if not is_vision_config(model):
        return False
    ensure_torchvision()
    register_in_process(model)
    return True
