"""What the endpoints share: rendering, the live output and stream state of a generation,
SSE framing, vLLM's model objects, errors."""
