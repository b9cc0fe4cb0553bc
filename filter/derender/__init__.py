"""derender: an Envoy ext_proc filter that serves OpenAI chat completions from vLLM token-in/token-out producers."""

__version__ = "0.1.0"
