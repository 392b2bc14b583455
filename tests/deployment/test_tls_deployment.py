"""Static checks of the TLS deployment examples (docker-compose.tls.yml, k8s/overlays/tls):
the variables they set exist, the files they name are where they mount the secret, and their
probes call the healthcheck with flags it takes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service import healthcheck
from service.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
TLS_OVERLAY = ROOT / "k8s" / "overlays" / "tls"
SETTINGS_ENV = {env_name(name) for name in Settings.__dataclass_fields__}
TLS_ENV = {"ATTENTION_TLS_CERT", "ATTENTION_TLS_KEY", "ATTENTION_TLS_CLIENT_CA"}


def _probe_args(command: list[str]) -> list[str]:
    """The healthcheck's own flags from a probe command (after `python -m service.healthcheck`)."""
    assert command[:3] == ["python", "-m", "service.healthcheck"], command
    return command[3:]


def _check_probe(command: list[str], mounted: set[str]) -> None:
    args = healthcheck.build_parser().parse_args(_probe_args(command))
    assert args.target == "127.0.0.1:8001"
    # Mutual TLS: the probe trusts the CA and presents a certificate, all from the secret.
    assert {str(args.tls_ca), str(args.tls_cert), str(args.tls_key)} <= mounted, args
    assert args.tls_server_name


def test_compose_tls_override_mounts_secrets_the_server_reads() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.tls.yml").read_text())
    server = compose["services"]["attention"]
    environment = server["environment"]
    assert set(environment) <= SETTINGS_ENV
    assert set(environment) == TLS_ENV
    mounted = {f"/run/secrets/{name}" for name in server["secrets"]}
    assert set(environment.values()) <= mounted
    assert set(server["secrets"]) == set(compose["secrets"])
    for secret in compose["secrets"].values():
        assert secret["file"].startswith("./tls/")  # ignored by git: keys are never committed
    assert "/tls/" in (ROOT / ".gitignore").read_text().splitlines()
    test = server["healthcheck"]["test"]
    assert test[0] == "CMD"
    _check_probe(test[1:], mounted)


def _tls_patch() -> dict:
    (patch,) = [
        doc
        for doc in yaml.safe_load_all((TLS_OVERLAY / "component/deployment-patch.yaml").read_text())
        if doc
    ]
    return patch


def test_kubernetes_tls_component_mounts_the_secret_as_a_directory() -> None:
    component = yaml.safe_load((TLS_OVERLAY / "component/kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    overlay = yaml.safe_load((TLS_OVERLAY / "kustomization.yaml").read_text())
    assert overlay["components"] == ["component"]
    assert (TLS_OVERLAY / overlay["resources"][0]).resolve() == ROOT / "k8s/overlays/cpu"
    pod = _tls_patch()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert set(env) == TLS_ENV
    (mount,) = container["volumeMounts"]
    assert "subPath" not in mount, "a subPath mount never sees a rotated Secret"
    assert mount["readOnly"] is True
    mounted = {f"{mount['mountPath']}/{key}" for key in ("tls.crt", "tls.key", "ca.crt")}
    assert set(env.values()) == mounted
    (volume,) = pod["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["secret"]["secretName"] == "attention-tls"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] is None  # removed: Kubernetes' gRPC probe has no TLS
        _check_probe(container[probe]["exec"]["command"], mounted)
    readiness = healthcheck.build_parser().parse_args(
        _probe_args(container["readinessProbe"]["exec"]["command"])
    )
    assert readiness.service == "attention.v1.AttentionService"


def test_tls_examples_pass_yamllint() -> None:
    yamllint = shutil.which("yamllint", path=str(Path(sys.executable).parent))
    assert yamllint, "yamllint is not installed; pip install -e '.[dev]'"
    done = subprocess.run(
        [yamllint, "--strict", "-c", ".yamllint.yaml", "docker-compose.tls.yml", str(TLS_OVERLAY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_kustomize_renders_the_tls_overlay() -> None:
    """With kubectl at hand: the real kustomize merges the component into the CPU overlay."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run(
        [kubectl, "kustomize", str(TLS_OVERLAY)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    resources = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    kinds = {r["kind"] for r in resources}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "NetworkPolicy"} <= kinds
    deployment = next(r for r in resources if r["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert TLS_ENV <= set(env) <= SETTINGS_ENV
    assert env["ATTENTION_PROVIDER"] == "cpu"  # the CPU overlay's patch survived
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(container[probe]) & {"grpc", "exec"} == {"exec"}, container[probe]
    assert {v["name"] for v in pod["volumes"]} == {"tls", "tmp"}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/attention/tls", "/tmp"}
    assert pod["securityContext"]["fsGroup"] == 10001  # owns the Secret's files (mode 0440)
