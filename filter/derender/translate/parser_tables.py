"""The lean path's vLLM patch: the streaming parser engine's drop tables built once per (config,
tokenizer) and shared. Installed by the first ``Model`` on the lean stream path; a process that serves
only ``--stream-path vllm`` never patches vLLM.
"""

from __future__ import annotations

from typing import Any


def memoize() -> None:
    """vLLM's streaming parser engine, built for every parser object (three per chat request: the
    render's, the filter's early one and the generator's), rebuilds from the tokenizer's special
    tokens the same drop table each time: a regex per special token (``regex.escape`` ~0.1 ms
    each) and a ``LexerShape``, which vLLM documents as immutable and shares. Built once per
    (engine config, tokenizer) here -- vLLM caches its configs, so they are the same objects --
    and shared, as vLLM shares the config's own shape.
    ``tests/test_lean.py`` checks the shared table equals a fresh one for every shipped parser."""
    from . import vllm_seams

    build = vllm_seams.parser_drop_table_builder()
    if getattr(build, "derender_memo", False):
        return
    tables: dict[tuple[int, int], tuple[Any, Any, Any]] = {}

    def drop_info(config: Any, tokenizer: Any) -> Any:
        key = (id(config), id(tokenizer))
        hit = tables.get(key)
        if hit is None or hit[0] is not config or hit[1] is not tokenizer:
            hit = tables[key] = (config, tokenizer, build(config, tokenizer))  # the pair kept: ids stay theirs
        return hit[2]

    drop_info.derender_memo = True  # type: ignore[attr-defined]
    drop_info.built = build  # type: ignore[attr-defined]
    drop_info.tables = tables  # type: ignore[attr-defined]
    vllm_seams.set_parser_drop_table_builder(drop_info)
