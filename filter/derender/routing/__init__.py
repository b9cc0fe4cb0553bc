"""Which backend and producer a request goes to."""
