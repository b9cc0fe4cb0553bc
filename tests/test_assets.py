"""The pinned tokenizers load as vLLM loads them, without a false alarm, and tokenize as the
tokenizer files say."""

from __future__ import annotations

import pytest
from derender.ops import assets

TEXTS = [
    "Hello world, it's 18°C — naïve café ✓",
    "東京の天気を確認します 🌧️☔ 用户想知道东京的天气。",
    "def f(x):\n    return x ** 2  # ok\n\n\tTabs and   spaces",
    "<think>\nreasoning</think>\n\n<tool_call>{\"name\": \"get_weather\"}</tool_call>",
    "CamelCaseWords, ALLCAPS and lowerCase; numbers 1234567 and 3.14159",
]


@pytest.mark.parametrize("name", list(assets.ASSETS))
def test_no_false_regex_alarm_and_the_tokenizer_files_own_ids(name, capfd):
    """transformers 5 warns that a local tokenizer folder without ``transformers_version`` in its
    config.json has Mistral's "incorrect regex pattern". The warning is false for these tokenizers:
    they load without it, and the tokenizer vLLM renders with gives exactly the ids of the
    tokenizer.json the package ships (the suggested ``fix_mistral_regex`` replaces the
    pre-tokenizer with Mistral's)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = assets.fetch(name, quiet=True)
    capfd.readouterr()
    loaded = AutoTokenizer.from_pretrained(str(folder))  # (transformers logs to stderr itself)
    assert "incorrect regex pattern" not in capfd.readouterr().err
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert loaded.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids, text
