"""Running it: the local stack, workers, child processes, warm-up, metrics, logs, keys, assets."""
