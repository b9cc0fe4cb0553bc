"""One module per client endpoint: chat, completions, Anthropic Messages, OpenAI Responses,
tokenization, and render-tier mode's exchanges."""
