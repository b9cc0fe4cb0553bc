"""The several-models config file (``derender serve|up --config FILE``).

YAML, one entry per served model::

    models:
      - name: qwen3                     # served model name(s): a string or a list
        model: ~/.cache/derender/models/qwen3   # tokenizer folder (vllm serve's --model)
        max_model_len: 4096
        reasoning_parser: qwen3
        tool_call_parser: hermes
        enable_auto_tool_choice: true
        default_chat_template_kwargs: {enable_thinking: false}
        producer:
          cluster: qwen3                # Envoy cluster of this model's producers
          url: http://10.0.0.7:8000     # or a list of URLs (one cluster, several endpoints)
          kv_events: [tcp://10.0.0.7:5557]   # kv-events routing: each URL's events (or ":5557" for all)
          kv_events_replay: [":5558"]        # and their replay sockets (optional)
          prefill: [http://10.0.0.6:8000]    # prefill producers: long prompts' KV handed to url's (optional)
        routing: prefix                 # least-request | prefix | precise | kv-events (default: --routing)
        replica_capacity: 8             # flow control: requests in flight per replica (default: the flag's)
      - name: [r1, deepseek-r1]
        render_url: http://10.0.0.9:8000   # render-tier mode: no model is loaded for it
        producer: {cluster: r1, url: http://10.0.0.8:8000}

Relative ``model`` folders are relative to the file. ``chat_template`` is a
file (also relative to the file) or a template string. Several entries may
share a cluster only with the same URLs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..ops.envoy_config import producer_cluster
from ..translate.model import ModelSpec

CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RESERVED_CLUSTERS = {"derender"}  # the ext_proc cluster of the Envoy templates
ROUTINGS = ("least-request", "prefix", "precise", "kv-events")  # derender.routing.balance.MODES
_KEYS = {
    "name",
    "model",
    "max_model_len",
    "chat_template",
    "reasoning_parser",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "default_chat_template_kwargs",
    "producer",
    "render_url",
    "routing",
    "replica_capacity",
    "enable_prompt_tokens_details",
    "stream_interval",
    "lora_modules",
    "allowed_local_media_path",
    "allowed_media_domains",
    "mm_processor_cache_gb",
}


class ConfigError(ValueError):
    """The config file is wrong; the message says where."""


@dataclass(frozen=True)
class ModelEntry:
    """One served model: how to render it and where its producers are."""

    names: tuple[str, ...]
    spec: ModelSpec | None  # None in render-tier mode
    cluster: str
    producer_urls: tuple[str, ...]
    render_url: str | None = None
    routing: str | None = None  # None: the --routing flag's
    kv_events: tuple[str, ...] = ()  # the producers' KV events endpoints (None: the flags')
    kv_events_replay: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()  # prefill producers (the prefill/decode handoff; none: the --prefill flag's)
    replica_capacity: int | None = None  # flow control (None: the --replica-capacity flag's)

    @property
    def producer_url(self) -> str:
        """The URL the filter sends aborts to."""
        return self.producer_urls[0]


def load(path: str | Path) -> list[ModelEntry]:
    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{path}: expected a top-level 'models:' list with at least one entry")
    entries = [_entry(path, i, item) for i, item in enumerate(models)]
    _check_unique(path, entries)
    return entries


def _entry(path: Path, i: int, item: Any) -> ModelEntry:
    where = f"{path}: models[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = set(item) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    names = item.get("name")
    names = [names] if isinstance(names, str) else names
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: 'name' must be a model name or a list of names")
    producer = item.get("producer")
    if not isinstance(producer, dict) or set(producer) - {"cluster", "url", "kv_events", "kv_events_replay", "prefill"}:
        raise ConfigError(
            f"{where}: 'producer' must be a mapping with 'cluster' and 'url' (and optionally 'kv_events', "
            "'kv_events_replay', 'prefill')"
        )
    events = {}
    for name in ("kv_events", "kv_events_replay", "prefill"):
        value = producer.get(name, [])
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{where}: producer.{name} must be an endpoint or a list of them")
        events[name] = tuple(value)
    cluster, urls = producer.get("cluster"), producer.get("url")
    urls = [urls] if isinstance(urls, str) else urls
    if not isinstance(cluster, str) or not CLUSTER_NAME.match(cluster) or cluster in RESERVED_CLUSTERS:
        raise ConfigError(
            f"{where}: producer.cluster must be a name of letters, digits, '_', '.', '-' (not 'derender')"
        )
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ConfigError(f"{where}: producer.url must be a URL or a list of URLs")
    render_url = item.get("render_url")
    spec = None
    if render_url is None:
        spec = _spec(path, where, item, names)
    elif not isinstance(render_url, str):
        raise ConfigError(f"{where}: render_url must be a URL")
    routing = item.get("routing")
    if routing is not None and routing not in ROUTINGS:
        raise ConfigError(f"{where}: routing must be one of {', '.join(ROUTINGS)}")
    capacity = item.get("replica_capacity")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ConfigError(f"{where}: replica_capacity must be a whole number >= 0 (0: no flow control)")
    return ModelEntry(
        tuple(names), spec, cluster, tuple(urls), render_url, routing, **events, replica_capacity=capacity
    )


def _spec(path: Path, where: str, item: dict[str, Any], names: list[str]) -> ModelSpec:
    if not isinstance(item.get("model"), str):
        raise ConfigError(f"{where}: 'model' (the tokenizer folder) is required without render_url")
    folder = (path.parent / Path(item["model"]).expanduser()).resolve()
    if not folder.is_dir():
        raise ConfigError(f"{where}: model folder {folder} does not exist")
    template = item.get("chat_template")
    if isinstance(template, str) and (path.parent / template).is_file():
        template = str((path.parent / template).resolve())
    kwargs = item.get("default_chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"{where}: default_chat_template_kwargs must be a mapping")
    interval = item.get("stream_interval", 1)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(f"{where}: stream_interval must be a positive integer")
    max_model_len = item.get("max_model_len")
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
        raise ConfigError(f"{where}: max_model_len must be a positive integer")
    loras = item.get("lora_modules") or []
    if not isinstance(loras, list) or not all(isinstance(m, (str, dict)) and m for m in loras):
        raise ConfigError(f"{where}: lora_modules must be a list of 'name=path' or {{name, path}} mappings")
    domains = item.get("allowed_media_domains") or []
    if not isinstance(domains, list) or not all(isinstance(d, str) for d in domains):
        raise ConfigError(f"{where}: allowed_media_domains must be a list of host names")
    cache_gb = item.get("mm_processor_cache_gb", 0.5)
    if not isinstance(cache_gb, (int, float)) or isinstance(cache_gb, bool) or cache_gb < 0:
        raise ConfigError(f"{where}: mm_processor_cache_gb must be a number >= 0")
    media_path = item.get("allowed_local_media_path")
    if media_path is not None:
        media_path = str((path.parent / Path(str(media_path)).expanduser()).resolve())
    return ModelSpec(
        model=str(folder),
        served_model_name=tuple(names),
        max_model_len=max_model_len,
        chat_template=template,
        reasoning_parser=item.get("reasoning_parser"),
        tool_call_parser=item.get("tool_call_parser"),
        enable_auto_tool_choice=bool(item.get("enable_auto_tool_choice", False)),
        default_chat_template_kwargs=json.dumps(kwargs) if kwargs is not None else None,
        enable_prompt_tokens_details=bool(item.get("enable_prompt_tokens_details", False)),
        stream_interval=interval,
        lora_modules=tuple(m if isinstance(m, str) else json.dumps(m) for m in loras),  # vllm's JSON form
        allowed_local_media_path=media_path,
        allowed_media_domains=tuple(domains),
        mm_processor_cache_gb=float(cache_gb),
    )


def _check_unique(path: Path, entries: list[ModelEntry]) -> None:
    seen: dict[str, int] = {}
    clusters: dict[str, tuple[str, ...]] = {}
    routings: dict[str, str | None] = {}
    for i, entry in enumerate(entries):
        for name in entry.names:
            if name in seen:
                raise ConfigError(f"{path}: model name {name!r} is in models[{seen[name]}] and models[{i}]")
            seen[name] = i
        if clusters.setdefault(entry.cluster, entry.producer_urls) != entry.producer_urls:
            raise ConfigError(f"{path}: cluster {entry.cluster!r} is given different URLs")
        if routings.setdefault(entry.cluster, entry.routing) != entry.routing:
            raise ConfigError(f"{path}: cluster {entry.cluster!r} is given different routing")


def envoy_clusters(entries: list[ModelEntry], routing: str = "least-request") -> str:
    """The producer clusters for ``envoy/multi.yaml``: one YAML list item per line, each
    balancing as its entry's ``routing`` (else ``routing``) asks."""
    lines, done = [], set()
    for entry in entries:
        if entry.cluster in done:
            continue
        done.add(entry.cluster)
        cluster = producer_cluster(entry.cluster, entry.producer_urls, entry.routing or routing)
        lines.append("  - " + json.dumps(cluster))
    return "\n".join(lines)
