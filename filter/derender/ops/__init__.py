"""Running it: metrics, logs, keys, warm-up, assets, Envoy configs, child processes."""
