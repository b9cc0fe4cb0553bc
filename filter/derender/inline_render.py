"""Small requests rendered on the event loop: no thread hand-offs for a millisecond of work.

vLLM's renderer runs the chat template and the tokenizer on its thread pool, one
hand-off each. For a request of a few kilobytes that work takes less than the
hand-offs: two trips through the pool and back to the loop, and under load the
GIL switch between the loop and the pool thread. ``small(raw)`` marks the render
of a body of at most ``INLINE_BYTES`` so that both calls run right here and hand
back an already finished future; larger bodies still go to the pool, so that a
long prompt's tokenization (which releases the GIL) does not hold up the other
streams of the worker. The functions called are vLLM's own, unchanged.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

INLINE_BYTES = 16_384  # ~4k tokens of text: ~1-3 ms of template and tokenizer work

_small: ContextVar[bool] = ContextVar("derender_small_render", default=False)


@contextmanager
def small(raw: bytes) -> Iterator[None]:
    """Within this block, the renderer's pool calls run inline if ``raw`` is small."""
    token = _small.set(len(raw) <= INLINE_BYTES)
    try:
        yield
    finally:
        _small.reset(token)


def install(renderer: Any) -> bool:
    """Route the renderer's template and tokenizer calls through ``small``; False if it has neither."""
    installed = False
    template = getattr(renderer, "_apply_chat_template_async", None)
    if template is not None:
        from vllm.renderers.hf import safe_apply_chat_template

        renderer._apply_chat_template_async = _inline_or(safe_apply_chat_template, template)
        installed = True
    tokenize = getattr(renderer, "_tokenize_prompt_async", None)
    if tokenize is not None:
        # Looked up on each call: ``longprompt.install`` may have replaced it.
        renderer._tokenize_prompt_async = _inline_or(lambda *a, **k: renderer._tokenize_prompt(*a, **k), tokenize)
        installed = True
    return installed


def _inline_or(run: Callable[..., Any], pooled: Callable[..., Any]) -> Callable[..., Any]:
    """``pooled`` (vLLM's ``make_async`` wrapper), or ``run`` inline when the render is small."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not _small.get():
            return pooled(*args, **kwargs)
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(run(*args, **kwargs))
        except Exception as exc:  # raised where the caller awaits, as from the pool
            future.set_exception(exc)
        return future

    return call
