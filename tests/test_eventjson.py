"""``translate.eventjson.loads`` gives what ``json.loads`` gives -- the same value, of the same types,
or the same kind of error -- for any text: producer events of every shape, and JSON's edge cases."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from derender.translate import eventjson


def _typed(value):
    """A value with every scalar's type (and a float's bits) spelled out, for an exact comparison."""
    if isinstance(value, dict):
        return ("dict", [(k, _typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [_typed(v) for v in value])
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value.hex())
    return (type(value).__name__, value)


def _outcome(loads, text: bytes):
    try:
        return _typed(loads(text))
    except (ValueError, RecursionError) as exc:
        return ("error", ValueError if isinstance(exc, ValueError) else RecursionError)


NUMBER = st.one_of(
    st.integers(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True, allow_infinity=True),
    st.from_regex(r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,25})?([eE][-+]?[0-9]{1,4})?", fullmatch=True),
)
STRING = st.one_of(st.text(), st.from_regex(r'([a-z ]|\\u[dD][89abAB][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\[nt"\\/])*',
                                            fullmatch=True))
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER.map(str), STRING.map(lambda s: f'"{s}"'),
                   st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "true", "null"]))


def _array(items):
    return st.lists(items, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")


def _object(items):
    keys = st.one_of(st.sampled_from(["choices", "token_ids", "index", "a"]), st.text(max_size=5).map(json.dumps))
    return st.lists(st.tuples(keys, items), max_size=4).map(
        lambda kv: "{" + ",".join(f"{k if k.startswith(chr(34)) else json.dumps(k)}:{v}" for k, v in kv) + "}")


JSON_TEXT = st.recursive(SCALAR.map(lambda s: "null" if s is None else str(s).lower() if isinstance(s, bool) else s),
                         lambda inner: st.one_of(_array(inner), _object(inner)), max_leaves=30)


def _event(ids, finish, extra):
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": ids, "logprobs": None}
    return json.dumps({"request_id": "generate-tokens-x", "usage": None, "output_mode": "tokens",
                       "choices": [choice], **extra}, ensure_ascii=False).encode()


EVENT = st.builds(_event, st.lists(st.integers(0, 2**40), max_size=8), st.sampled_from([None, "stop", "length"]),
                  st.dictionaries(st.text(max_size=6), st.one_of(st.none(), st.integers(), st.text()), max_size=2))


@settings(max_examples=1500, deadline=None)
@given(st.one_of(JSON_TEXT.map(str.encode), EVENT, st.binary(max_size=40),
                 st.tuples(JSON_TEXT, st.sampled_from(["", " ", "\n", " x", ",", "]"])).map(lambda t: (t[0] + t[1]).encode())))
@example(b'{"a":1,"a":2}')
@example(b'{"a":123456789012345678901234567890,"b":-9223372036854775809}')
@example(b'{"a":1e400,"b":NaN}')
@example(b'{"a":"\\ud800"}')
@example(b'{"a":"\xff"}')
@example(b'{"a":2.4e-320,"b":1.0000000000000002,"c":-0.0,"d":-0}')
@example(b"[" * 300 + b"]" * 300)
@example(b"[" * 5000 + b"]" * 5000)
def test_loads_is_json_loads(text):
    assert _outcome(eventjson.loads, text) == _outcome(json.loads, text)


def test_the_fast_decoder_takes_an_event(monkeypatch):
    """What the test compares is two decoders: a plain event does not fall back to ``json.loads``."""
    calls = []
    monkeypatch.setattr(eventjson, "json", SimpleNamespace(loads=lambda text: calls.append(text) or json.loads(text)))
    event = _event([1, 2], None, {})
    assert eventjson.loads(event) == json.loads(event)
    assert calls == []
    eventjson.loads(b'{"a":NaN}')
    assert calls == [b'{"a":NaN}']
