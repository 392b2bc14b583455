"""Static checks of the poll-mode deployment examples (docker-compose.rollout.yml,
k8s/overlays/rollout): the variables exist and parse as settings, the repository is mounted
where the server reads it, and the claim the pods mount is the one the overlay creates."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service.settings import Settings, env_name, load_settings

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "k8s" / "overlays" / "rollout"
SETTINGS_ENV = {env_name(name) for name in Settings.__dataclass_fields__}
REPOSITORY = "/models"  # ATTENTION_MODEL_REPOSITORY in the image (Dockerfile)


def _valid(environment: dict[str, str]) -> Settings:
    assert set(environment) <= SETTINGS_ENV
    settings = load_settings([], environ=environment)
    assert settings.model_control_mode == "poll"
    return settings


def _key_file_is_mounted(settings: Settings, path: str) -> None:
    """The example restricts the repository API with a key read from the mounted Secret."""
    (spec,) = settings.restricted_api
    groups, _, key = spec.partition(":")
    assert "model-repository" in groups.split(",")
    assert key.partition("=")[2] == f"@{path}"


def test_compose_override_polls_a_mounted_repository() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.rollout.yml").read_text())
    server = compose["services"]["attention"]
    settings = _valid(server["environment"])
    (secret,) = server["secrets"]
    assert secret["source"] in compose["secrets"]
    _key_file_is_mounted(settings, f"/run/secrets/{secret['target']}")
    (volume,) = server["volumes"]
    source, target, mode = volume.split(":")
    assert (source, target, mode) == ("./models", REPOSITORY, "ro")
    assert f"ATTENTION_MODEL_REPOSITORY={REPOSITORY}" in (ROOT / "Dockerfile").read_text()


def test_kubernetes_component_mounts_the_claim_the_overlay_creates() -> None:
    component = yaml.safe_load((OVERLAY / "component/kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    overlay = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert overlay["components"] == ["component"]
    (patch,) = [
        doc
        for doc in yaml.safe_load_all((OVERLAY / "component/deployment-patch.yaml").read_text())
        if doc
    ]
    pod = patch["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    settings = _valid({item["name"]: item["value"] for item in container["env"]})
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert set(mounts) == set(volumes) == {"models", "admin-key"}
    mount, volume = mounts["models"], volumes["models"]
    assert mount["mountPath"] == REPOSITORY
    assert mount["readOnly"] is True
    assert volumes["admin-key"]["secret"]["secretName"] == "attention-admin-key"
    _key_file_is_mounted(settings, mounts["admin-key"]["mountPath"] + "/key")
    claim = yaml.safe_load((OVERLAY / "pvc.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim"
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_rollout_examples_pass_yamllint() -> None:
    yamllint = shutil.which("yamllint") or str(Path(__file__).parents[2] / ".venv/bin/yamllint")
    done = subprocess.run(
        [yamllint, "--strict", "-c", ".yamllint.yaml", "docker-compose.rollout.yml", str(OVERLAY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_rollout_overlay() -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True
    ).stdout
    resources = [doc for doc in yaml.safe_load_all(built) if doc]
    (deployment,) = [r for r in resources if r["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["ATTENTION_MODEL_CONTROL_MODE"] == "poll"
    assert env["ATTENTION_MODEL_REPOSITORY"] == REPOSITORY
    assert any(r["kind"] == "PersistentVolumeClaim" for r in resources)
