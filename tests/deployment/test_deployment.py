"""Static checks of the Dockerfile, compose file, monitoring and Kubernetes manifests
(no Docker engine or cluster runs here): they must agree with the code they deploy."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from service.observability import metrics
from service.observability.gpu_metrics import GpuCollector
from service.observability.process_metrics import ProcessCollector
from service.settings import ENV_PREFIX, Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SETTINGS_ENV = {env_name(name) for name in Settings.__dataclass_fields__}


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomize(folder: Path) -> list[dict]:
    """Resources a kustomization pulls in (recursively), patches applied by name only."""
    config = yaml.safe_load((folder / "kustomization.yaml").read_text())
    resources: list[dict] = []
    for entry in config.get("resources", []):
        target = (folder / entry).resolve()
        assert target.exists(), f"{folder}: resource {entry} does not exist"
        resources += _kustomize(target) if target.is_dir() else _docs(target)
    for patch in config.get("patches", []):
        for doc in _docs(folder / patch["path"]):
            names = [(r["kind"], r["metadata"]["name"]) for r in resources]
            assert (doc["kind"], doc["metadata"]["name"]) in names, f"patch targets nothing: {doc}"
    return resources


def _env_names(container: dict) -> set[str]:
    return {item["name"] for item in container.get("env", [])}


def test_dockerfile_exports_in_a_build_stage_and_serves_without_torch() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 4
    export_stage, gateway_stage, deps_stage, serve_stage = stages
    # The gRPC gateway is built from source in a stage of its own; the image gets the binary.
    assert "AS gateway" in gateway_stage
    assert "go build" in gateway_stage
    assert "CGO_ENABLED=0" in gateway_stage  # static: any base runs it
    assert (
        "COPY --from=gateway /opt/attention-gateway /opt/venv/bin/attention-gateway" in serve_stage
    )
    assert "AS export" in export_stage
    assert "python -m export" in export_stage
    assert "torch" in export_stage
    for stage in (gateway_stage, deps_stage, serve_stage):
        assert "torch" not in stage.replace("no torch", "")
    assert "COPY --from=export" in serve_stage
    assert "COPY --from=deps" in serve_stage
    assert re.search(r"^USER 10001$", serve_stage, re.M)
    assert re.search(r"^EXPOSE 8000 8001 8002$", serve_stage, re.M)
    assert '"python", "-m", "service"' in serve_stage
    # GPU-capable by default; offline builds (scripts/build-image-offline.sh) override these.
    assert re.search(
        r'^ARG ONNXRUNTIME="onnxruntime-gpu\[cuda,cudnn\]==\S+ nvidia-cublas"', deps_stage, re.M
    )
    # The NVIDIA wheels of the GPU build are pinned (cuBLAS by name), not whatever pip resolves.
    assert "-c constraints-gpu.txt" in deps_stage
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    assert re.search(r"^ENV LD_LIBRARY_PATH=/usr/local/nvidia/lib64:", serve_stage, re.M)
    for source in re.findall(r"^COPY (?!--from)(?:--\S+ )*(.+) \S+$", text, re.M):
        for name in source.split():
            assert (ROOT / name).exists(), f"Dockerfile copies missing {name}"
    for variable in re.findall(rf"({ENV_PREFIX}\w+)=", text):
        assert variable in SETTINGS_ENV, f"Dockerfile sets unknown {variable}"


def _tool(name: str) -> str:
    """A linter installed beside this interpreter (the dev extra brings both)."""
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert path, f"{name} is not installed; pip install -e '.[dev]'"
    return path


def test_dockerfile_passes_hadolint() -> None:
    done = subprocess.run(
        [_tool("hadolint"), "Dockerfile"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_yaml_files_pass_yamllint() -> None:
    files = [
        "docker-compose.yml",
        "docker-compose.gpu.yml",
        "docker-compose.tracing.yml",
        "k8s",
        "monitoring",
    ]
    done = subprocess.run(
        [_tool("yamllint"), "--strict", "-c", ".yamllint.yaml", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_runs_server_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"attention", "prometheus", "grafana"}
    server = services["attention"]
    assert server["build"]["target"] == "serve"
    assert {"8001:8001", "8002:8002"} <= set(server["ports"])
    assert set(server["environment"]) <= SETTINGS_ENV
    assert server["read_only"] is True
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            assert (ROOT / volume.split(":")[0]).exists(), volume
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]["attention"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert set(gpu["environment"]) <= SETTINGS_ENV


def test_tracing_compose_sends_otlp_to_jaeger() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.tracing.yml").read_text())["services"]
    server, jaeger = services["attention"], services["jaeger"]
    assert server["environment"]["ATTENTION_TRACING"] == "on"
    assert set(server["environment"]) <= SETTINGS_ENV | {
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    }
    assert server["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert server["environment"]["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert "4317:4317" in jaeger["ports"]
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["attention"]
    assert "8000:8000" in base["ports"]  # HTTP/REST, Triton's port


def test_prometheus_scrapes_the_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    targets = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["attention:8002"]


def test_dashboard_queries_only_metrics_that_exist() -> None:
    families = [
        family
        for collector in vars(metrics).values()
        if isinstance(collector, MetricWrapperBase)
        for family in collector.describe()
    ]
    families += list(metrics.ServedSetCollector().collect())
    # The supervisor's own: every process's CPU and memory, and a GPU's series where one is.
    families += [*ProcessCollector(dict).describe(), *GpuCollector().describe()]
    declared = {family.name for family in families}
    dashboard = json.loads((ROOT / "monitoring/grafana/dashboards/attention.json").read_text())
    queried = {
        re.sub(r"_(bucket|sum|count|total)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\battention_[a-z_]+", target["expr"])
    }
    assert queried, "the dashboard queries nothing"
    assert queried <= declared, queried - declared


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_overlay_has_every_required_object(overlay: str) -> None:
    resources = _kustomize(K8S / "overlays" / overlay)
    kinds = {r["kind"] for r in resources}
    assert {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "NetworkPolicy",
    } <= kinds
    services = [r for r in resources if r["kind"] == "Service"]
    assert any(s["spec"].get("clusterIP") == "None" for s in services)
    assert any(s["spec"].get("type") == "ClusterIP" for s in services)
    deployment = next(r for r in resources if r["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 8001
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"]["cpu"]
    assert _env_names(container) <= SETTINGS_ENV
    grace = next(e["value"] for e in container["env"] if e["name"] == "ATTENTION_GRACE_PERIOD_S")
    assert pod["terminationGracePeriodSeconds"] > float(grace)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 8001, "http": 8000, "metrics": 8002}


def test_gpu_overlay_asks_for_a_gpu() -> None:
    patch = _docs(K8S / "overlays/gpu/deployment-patch.yaml")[0]
    container = patch["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "ATTENTION_PROVIDER", "value": "cuda"} in container["env"]
    assert _env_names(container) <= SETTINGS_ENV


def test_kserve_alternative_speaks_v2_on_the_grpc_port() -> None:
    (service,) = _kustomize(K8S / "kserve")
    assert service["kind"] == "InferenceService"
    container = service["spec"]["predictor"]["containers"][0]
    assert container["ports"] == [{"name": "h2c", "containerPort": 8001, "protocol": "TCP"}]
    assert container["readinessProbe"]["grpc"]["service"] == "inference.GRPCInferenceService"
    assert _env_names(container) <= SETTINGS_ENV
