"""What the agent-API tests script the producer with: a question, a tool call, the tool's result and
the answer, as Qwen3 (thinking) + hermes tokens, and the tool as each API declares it."""

from __future__ import annotations

IM_END = 151645  # <|im_end|>
QUESTION = "What is the weather in Paris? 🌦️"
THINKING = "The user wants Paris weather 🌧️. 天气 — call the tool."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris 🗼"}}\n</tool_call>'
TOOL_RESULT = "18°C and sunny ☀️"
FINAL = "It is 18°C and sunny in Paris ☀️."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_FUNCTION = {"type": "function", "name": "get_weather", "description": "Current weather for a city", "parameters": SCHEMA}
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather for a city", "input_schema": SCHEMA}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def tool_call_answer(tokenizer) -> list[int]:
    return encode(tokenizer, f"<think>\n{THINKING}\n</think>\n\n{CALL}") + [IM_END]


def two_turns(stack, tokenizer) -> None:
    """The producer's script: a tool call; once the prompt holds the tool's result, the answer."""
    stack.script.set(
        {"token_ids": tool_call_answer(tokenizer)},
        {"when": TOOL_RESULT, "token_ids": encode(tokenizer, f"<think>\nGot it.\n</think>\n\n{FINAL}") + [IM_END]},
    )
