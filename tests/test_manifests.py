"""The deployment manifests: docker/k8s (kustomize) and docker/compose*.yaml.

Every kustomization is rendered with ``kubectl kustomize`` and each object validated against
Kubernetes' own schemas (kubernetes-validate bundles them: no network). The compose files are
parsed by Debian's docker-compose 1.29 and by Compose v2. Then the rendered containers are
read as the programs they start would read them: the proxy's command line and environment
build the proxy's real ``Settings``, the trainer's arguments go through its real parser.

The tools come from ``.ci/manifests.sh`` (``make manifests``). A test whose tool is missing is
skipped on a developer's machine and fails in CI (``CI=true``), so a broken manifest fails CI.
"""

from __future__ import annotations

import argparse
import base64
import copy
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from proxy import Settings, create_app
from tracetrain_cli._serve_command import settings_from
from tracetrain_cli._serve_flags import add_serve_parser

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "docker" / "k8s"
KUSTOMIZATIONS = ["base", *(f"overlays/{p.name}" for p in sorted((K8S / "overlays").iterdir()))]
# The oldest Kubernetes release still common in managed clusters, and the newest schemas bundled.
K8S_VERSIONS = ("1.29.0", "1.37.0")
# Real-looking keys for rendering compose and building settings (never used anywhere else).
KEYS = {
    "POSTGRES_PASSWORD": "pg-" + "p" * 29,
    "TRACETRAIN_API_KEYS": "api-" + "a" * 28,
    "TRACETRAIN_REWARD_KEYS": "reward-" + "r" * 25,
    "TRACETRAIN_ADMIN_TOKEN": "admin-" + "t" * 26,
    "TRACETRAIN_ADAPTERS_KEY": "adapters-" + "k" * 23,
}


def _tool(name: str) -> str:
    """A tool from the venv's bin (where .ci/manifests.sh puts it) or PATH; skip, or fail in CI."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        message = f"{name} is not installed: run .ci/manifests.sh (make manifests), which installs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, env=env, timeout=120)


# ---------------------------------------------------------------- Kubernetes


def _render(kustomization: str) -> list[dict[str, Any]]:
    done = _run([_tool("kubectl"), "kustomize", str(K8S / kustomization)])
    assert done.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


_rendered: dict[str, list[dict[str, Any]]] = {}


def rendered(kustomization: str) -> list[dict[str, Any]]:
    if kustomization not in _rendered:
        _rendered[kustomization] = _render(kustomization)
    return _rendered[kustomization]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def resolved_env(objects: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The environment Kubernetes gives container ``c``: envFrom first, then env, from these objects."""

    def source(kind: str, prefix: str) -> dict[str, str]:
        obj = next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == prefix)
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}
        return dict(obj["data"])

    env: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        kind, key = ("ConfigMap", "configMapRef") if "configMapRef" in ref else ("Secret", "secretRef")
        env.update(source(kind, ref[key]["name"]))
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]
        kind, key = ("ConfigMap", "configMapKeyRef") if "configMapKeyRef" in ref else ("Secret", "secretKeyRef")
        env[item["name"]] = source(kind, ref[key]["name"])[ref[key]["key"]]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command and args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_kustomization_renders_objects_valid_against_kubernetes_schemas(kustomization: str) -> None:
    import kubernetes_validate

    objects = rendered(kustomization)
    assert {"Deployment", "StatefulSet", "Service", "Secret", "ConfigMap"} <= {o["kind"] for o in objects}
    for obj in objects:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{kustomization}: {obj['kind']}/{obj['metadata']['name']} is invalid in {version}: {exc}")


def test_schema_validation_rejects_a_misspelt_field() -> None:
    import kubernetes_validate

    deployment = one(rendered("overlays/cpu"), "Deployment", "proxy")
    container(deployment, "proxy")["readinesProbe"] = {"httpGet": {"path": "/readyz", "port": "http"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_proxy_probes_hit_the_proxys_readiness_and_liveness_routes() -> None:
    proxy = container(one(rendered("base"), "Deployment", "proxy"), "proxy")
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/healthz"
    paths = {getattr(route, "path", None) for route in create_app(Settings()).routes}
    assert {"/readyz", "/healthz"} <= paths


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in list(os.environ):
        if name.startswith("TRACETRAIN_"):
            monkeypatch.delenv(name)
    yield monkeypatch


def proxy_settings(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What ``tracetrain serve`` builds from this command line and environment."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert argv[:2] == ["tracetrain", "serve"], argv
    settings: Settings = settings_from(parser.parse_args(argv[1:]))
    return settings


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_the_proxy_refuses_the_shipped_placeholder_keys(overlay: str, clean_env: pytest.MonkeyPatch) -> None:
    objects = rendered(overlay)
    proxy = container(one(objects, "Deployment", "proxy"), "proxy")
    with pytest.raises(SystemExit, match="placeholder"):
        proxy_settings(proxy["command"] + proxy["args"], resolved_env(objects, proxy), clean_env)


def with_real_keys(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rendered objects, their keys Secret's placeholders replaced by real keys (KEYS) as a deployer's are."""
    copied = copy.deepcopy(objects)
    (keys,) = [o for o in copied if o["kind"] == "Secret" and o["metadata"]["name"].startswith("tracetrain-keys")]
    keys["data"] = {k: base64.b64encode(KEYS[k].encode()).decode() for k in keys["data"]}
    return copied


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_the_proxy_starts_from_its_container_spec_with_real_keys(overlay: str, clean_env: pytest.MonkeyPatch) -> None:
    objects = with_real_keys(rendered(overlay))
    proxy = container(one(objects, "Deployment", "proxy"), "proxy")
    env = resolved_env(objects, proxy)
    settings = proxy_settings(proxy["command"] + proxy["args"], env, clean_env)
    assert (settings.host, settings.port) == ("0.0.0.0", 8100)
    assert settings.database_url == env["TRACETRAIN_DATABASE_URL"]
    assert settings.database_url.startswith("postgresql+asyncpg://")
    assert (
        settings.admin_token is not None and settings.admin_token.get_secret_value() == KEYS["TRACETRAIN_ADMIN_TOKEN"]
    )
    service = one(objects, "Service", "tracetrain")
    assert service["spec"]["ports"][0]["port"] == settings.port


def test_the_proxies_list_every_vllm_pod_by_its_stable_name() -> None:
    objects = rendered("base")
    vllm = one(objects, "StatefulSet", "vllm")
    headless = one(objects, "Service", vllm["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    port = next(p["containerPort"] for p in container(vllm, "vllm")["ports"] if p["name"] == "http")
    upstreams = resolved_env(objects, container(one(objects, "Deployment", "proxy"), "proxy"))["TRACETRAIN_UPSTREAM"]
    expected = [f"http://vllm-{i}.vllm:{port}/v1" for i in range(vllm["spec"]["replicas"])]
    assert upstreams.split(",") == expected


def test_vllm_fetches_adapters_from_the_proxy_service_with_a_key_from_a_secret() -> None:
    objects = rendered("base")
    vllm = container(one(objects, "StatefulSet", "vllm"), "vllm")
    env = resolved_env(objects, vllm)
    service = one(objects, "Service", "tracetrain")
    assert env["TRACETRAIN_ADAPTERS_URL"] == f"http://tracetrain:{service['spec']['ports'][0]['port']}"
    key_ref = next(e for e in vllm["env"] if e["name"] == "TRACETRAIN_ADAPTERS_KEY")["valueFrom"]
    assert "secretKeyRef" in key_ref
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" in vllm["args"]


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_the_proxies_accept_the_key_vllm_fetches_adapters_with(overlay: str, clean_env: pytest.MonkeyPatch) -> None:
    objects = with_real_keys(rendered(overlay))
    sent = resolved_env(objects, container(one(objects, "StatefulSet", "vllm"), "vllm"))["TRACETRAIN_ADAPTERS_KEY"]
    proxy = container(one(objects, "Deployment", "proxy"), "proxy")
    settings = proxy_settings(proxy["command"] + proxy["args"], resolved_env(objects, proxy), clean_env)
    assert sent in [k.get_secret_value() for k in settings.adapter_keys]


@pytest.mark.parametrize(("overlay", "device"), [("overlays/cpu", "cpu"), ("overlays/gpu", "cuda")])
def test_the_trainer_arguments_parse_and_name_the_store_and_the_policy(overlay: str, device: str) -> None:
    from trainer.__main__ import parse_args

    objects = rendered(overlay)
    trainer = container(one(objects, "Deployment", "trainer"), "trainer")
    assert trainer["command"] == ["python3", "-m", "trainer"]
    env = resolved_env(objects, trainer)
    args = parse_args(expand(trainer["args"], env))
    assert args.database_url == env["TRACETRAIN_DATABASE_URL"]
    proxy_env = resolved_env(objects, container(one(objects, "Deployment", "proxy"), "proxy"))
    assert args.database_url == proxy_env["TRACETRAIN_DATABASE_URL"]
    assert args.policy == [proxy_env["TRACETRAIN_POLICY"]]
    assert args.device == device


def vllm_flags(argv: list[str]) -> dict[str, str]:
    """A vLLM command line as {flag: value} ("" for a bare flag), whether written ``--a=b`` or ``--a b``."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            flags[name] = value if eq else ("" if following.startswith("--") else following)
    return flags


# What `tracetrain serve` decides about its vLLM that a manifest must repeat: LoRA limits, logprobs, CPU tuning.
SERVE_FLAGS = ("--enable-lora", "--max-lora-rank", "--max-loras", "--logprobs-mode", "--no-enable-chunked-prefill",
               "--block-size", "--enable-chunked-prefill")  # fmt: skip


def serve_vllm_flags(device: str) -> dict[str, str]:
    from tracetrain_cli._vllm_process import VLLMLaunch

    launch = VLLMLaunch(model="/models/base", port=8000, data_dir=Path("/data"), device=device)  # type: ignore[arg-type]
    return {k: v for k, v in vllm_flags(launch.argv()).items() if k in SERVE_FLAGS}


def manifest_vllm_flags(variant: str) -> dict[str, str]:
    if variant.startswith("compose"):
        files = COMPOSE_SETS[variant.removeprefix("compose-")]
        services: dict[str, Any] = {}
        for name in files:  # an override's service replaces the keys it names, as compose merges them
            for service, spec in yaml.safe_load((ROOT / "docker" / name).read_text())["services"].items():
                services[service] = {**services.get(service, {}), **spec}
        argv = str(services["vllm-a"]["command"]).split()
    else:
        argv = container(one(rendered(variant), "StatefulSet", "vllm"), "vllm")["args"]
    return {k: v for k, v in vllm_flags(argv).items() if k in SERVE_FLAGS}


@pytest.mark.parametrize(
    ("variant", "device"),
    [
        ("compose-cpu", "cpu"),
        ("compose-gpu", "cuda"),
        ("base", "cpu"),
        ("overlays/cpu", "cpu"),
        ("overlays/gpu", "cuda"),
    ],
)
def test_each_vllm_starts_with_the_flags_serve_gives_a_vllm_on_its_device(variant: str, device: str) -> None:
    assert manifest_vllm_flags(variant) == serve_vllm_flags(device)


def gpus(workload: dict[str, Any]) -> list[str | None]:
    return [
        c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        for c in workload["spec"]["template"]["spec"]["containers"]
    ]


def test_the_gpu_overlay_gives_each_vllm_server_and_the_trainer_one_gpu_and_the_cpu_overlay_none() -> None:
    gpu, cpu = rendered("overlays/gpu"), rendered("overlays/cpu")
    assert gpus(one(gpu, "StatefulSet", "vllm")) == ["1"]
    assert gpus(one(gpu, "Deployment", "trainer")) == ["1"]
    assert gpus(one(gpu, "Deployment", "proxy")) == [None]
    assert "--no-enable-chunked-prefill" not in container(one(gpu, "StatefulSet", "vllm"), "vllm")["args"]
    assert all(g is None for o in cpu if o["kind"] in ("Deployment", "StatefulSet") for g in gpus(o))
    models = next(
        v for v in one(gpu, "StatefulSet", "vllm")["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"
    )
    assert models == {"name": "models", "persistentVolumeClaim": {"claimName": "tracetrain-models", "readOnly": True}}


def test_postgres_is_external_in_the_gpu_overlay_and_in_cluster_in_the_cpu_overlay() -> None:
    gpu, cpu = rendered("overlays/gpu"), rendered("overlays/cpu")
    assert not [o for o in gpu if o["metadata"]["name"] == "postgres"]
    postgres = one(cpu, "StatefulSet", "postgres")
    password = resolved_env(cpu, container(postgres, "postgres"))["POSTGRES_PASSWORD"]
    url = resolved_env(cpu, container(one(cpu, "Deployment", "proxy"), "proxy"))["TRACETRAIN_DATABASE_URL"]
    assert url == f"postgresql+asyncpg://tracetrain:{password}@postgres:5432/tracetrain"


# ---------------------------------------------------------------- Compose


def _compose_commands() -> list[list[str]]:
    v1, v2 = _tool("docker-compose"), _tool("docker-compose-v2")
    assert _run([v1, "version", "--short"]).stdout.startswith("1."), f"{v1} is not docker-compose 1.x"
    assert "v2." in _run([v2, "version"]).stdout, f"{v2} is not Compose v2"
    return [[v1], [v2]]


COMPOSE_SETS = {"cpu": ["compose.yaml"], "gpu": ["compose.yaml", "compose.gpu.yaml"]}


def compose_config(compose: list[str], files: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = list(compose)
    for name in files:
        argv += ["-f", str(ROOT / "docker" / name)]
    base = {k: v for k, v in os.environ.items() if k not in KEYS and k != "MODEL_DIR"}
    return _run([*argv, "config"], env=base | env)


@pytest.mark.parametrize("variant", sorted(COMPOSE_SETS))
def test_compose_files_parse_with_compose_1_29_and_v2(variant: str, clean_env: pytest.MonkeyPatch) -> None:
    for compose in _compose_commands():
        done = compose_config(compose, COMPOSE_SETS[variant], KEYS | {"MODEL_DIR": "/srv/model"})
        assert done.returncode == 0, f"{compose[0]} config ({variant}) failed:\n{done.stderr}"
        services = yaml.safe_load(done.stdout)["services"]
        assert set(services) == {"postgres", "model", "vllm-a", "vllm-b", "proxy-a", "proxy-b", "lb", "trainer"}
        assert all("healthcheck" in s for name, s in services.items() if name != "model")  # model runs once
        gpu_services = {name for name, s in services.items() if "deploy" in s}
        assert gpu_services == ({"vllm-a", "vllm-b", "trainer"} if variant == "gpu" else set())
        proxy = services["proxy-a"]
        command = proxy["command"] if isinstance(proxy["command"], list) else proxy["command"].split()
        settings = proxy_settings(command, {k: str(v) for k, v in proxy["environment"].items()}, clean_env)
        assert (
            settings.database_url
            == f"postgresql+asyncpg://tracetrain:{KEYS['POSTGRES_PASSWORD']}@postgres:5432/tracetrain"
        )
        assert proxy["environment"]["TRACETRAIN_UPSTREAM"] == "http://vllm-a:8000/v1,http://vllm-b:8000/v1"
        assert services["vllm-a"]["environment"]["TRACETRAIN_ADAPTERS_URL"] == "http://lb:8100"
        # The proxies accept the key each vLLM's resolver sends for adapter files.
        adapters_key = services["vllm-a"]["environment"]["TRACETRAIN_ADAPTERS_KEY"]
        assert adapters_key in [k.get_secret_value() for k in settings.adapter_keys]


def test_compose_runs_the_public_bases_unless_variables_name_local_ones() -> None:
    local = {"PYTHON_IMAGE": "tracetrain-base-python:bookworm", "POSTGRES_IMAGE": "tracetrain-base-postgres:bookworm",
             "NGINX_IMAGE": "tracetrain-base-nginx:bookworm"}  # fmt: skip
    for compose in _compose_commands():
        for env, (python, postgres, nginx) in (
            ({}, ("python:3.11-slim", "postgres:16", "nginx:1.27-alpine")),
            (local, tuple(local.values())),
        ):
            done = compose_config(compose, COMPOSE_SETS["cpu"], KEYS | env)
            assert done.returncode == 0, done.stderr
            services = yaml.safe_load(done.stdout)["services"]
            assert services["postgres"]["image"] == postgres and services["lb"]["image"] == nginx
            assert {s["build"]["args"]["PYTHON_IMAGE"] for s in services.values() if "build" in s} == {python}


def test_the_smoke_settings_make_a_job_of_two_groups_of_two(clean_env: pytest.MonkeyPatch) -> None:
    for compose in _compose_commands():
        done = compose_config(compose, ["compose.yaml", "compose.smoke.yaml"], KEYS)
        assert done.returncode == 0, done.stderr
        services = yaml.safe_load(done.stdout)["services"]
        for name in ("proxy-a", "proxy-b"):
            proxy = services[name]
            command = proxy["command"] if isinstance(proxy["command"], list) else proxy["command"].split()
            settings = proxy_settings(command, {k: str(v) for k, v in proxy["environment"].items()}, clean_env)
            assert (settings.group_size, settings.min_group_size, settings.batch_groups) == (2, 2, 2)
            assert proxy["environment"]["TRACETRAIN_UPSTREAM"] == "http://vllm-a:8000/v1,http://vllm-b:8000/v1"


def test_compose_refuses_to_start_without_keys() -> None:
    for compose in _compose_commands():
        done = compose_config(
            compose, COMPOSE_SETS["cpu"], {k: v for k, v in KEYS.items() if k != "TRACETRAIN_API_KEYS"}
        )
        assert done.returncode != 0
        assert "set TRACETRAIN_API_KEYS" in done.stderr


def test_the_gpu_variant_needs_a_model_directory() -> None:
    for compose in _compose_commands():
        done = compose_config(compose, COMPOSE_SETS["gpu"], KEYS)
        assert done.returncode != 0
        assert "set MODEL_DIR" in done.stderr


def test_nginx_balances_over_exactly_the_compose_proxies() -> None:
    conf = (ROOT / "docker" / "nginx.conf").read_text()
    servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", conf, flags=re.MULTILINE)
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    proxies = sorted(name for name in compose["services"] if name.startswith("proxy-"))
    assert sorted(host for host, _ in servers) == proxies
    assert {port for _, port in servers} == {"8100"}
    assert "proxy_buffering off" in conf  # streamed completions pass through unbuffered


def test_placeholder_secrets_are_all_rejected_by_the_proxy() -> None:
    for line in (K8S / "base" / "keys.env").read_text().splitlines():
        name, _, value = line.partition("=")
        if name in ("TRACETRAIN_API_KEYS", "TRACETRAIN_REWARD_KEYS", "TRACETRAIN_ADMIN_TOKEN"):
            field = name.removeprefix("TRACETRAIN_").lower()
            with pytest.raises(ValidationError, match="placeholder"):
                Settings(**{field: value})
