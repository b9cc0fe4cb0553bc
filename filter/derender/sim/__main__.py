"""``python -m derender.sim``: the producer simulator."""

import argparse

from .app import add_arguments, main

parser = argparse.ArgumentParser(
    description="Producer simulator: vLLM 0.33.0's POST /inference/v1/generate without a GPU."
)
add_arguments(parser)
raise SystemExit(main(parser.parse_args()))
