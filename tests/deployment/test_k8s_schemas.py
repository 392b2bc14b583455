"""Every Kubernetes object in k8s/, as kustomize renders each entry point, passes strict
schema validation (unknown fields rejected) for the Kubernetes versions we support. Custom
resources (ServiceMonitor, PrometheusRule, InferenceService) have no schema bundled here;
their contents are checked by test_deployment.py and test_monitoring.py."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SUPPORTED = ["1.31.0", "1.34.0", "1.37.0"]  # oldest we support, a middle one, newest bundled
CUSTOM = {"monitoring.coreos.com/v1", "serving.kserve.io/v1beta1"}
# Every kustomization one can `kubectl apply -k` (components are applied through those).
ENTRY_POINTS = sorted(
    str(path.parent.relative_to(K8S))
    for path in K8S.rglob("kustomization.yaml")
    if yaml.safe_load(path.read_text()).get("kind") != "Component"
)


def _render(entry: str) -> list[dict]:
    """kubectl kustomize when present (patches applied); else the files the entry pulls in."""
    return copy.deepcopy(_rendered(entry))


@functools.cache
def _rendered(entry: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl:
        done = subprocess.run(
            [kubectl, "kustomize", str(K8S / entry)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    config = yaml.safe_load((K8S / entry / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for resource in config.get("resources", []):
        target = (K8S / entry / resource).resolve()
        if target.is_dir():
            docs += _render(str(target.relative_to(K8S)))
        else:
            docs += [doc for doc in yaml.safe_load_all(target.read_text()) if doc]
    return docs


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("version", SUPPORTED)
def test_manifests_pass_strict_schema_validation(entry: str, version: str) -> None:
    docs = _render(entry)
    assert docs
    checked = 0
    for doc in docs:
        if doc["apiVersion"] in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{entry} {doc['kind']}/{doc['metadata']['name']} ({version}): {err}")
        checked += 1
    assert checked or entry == "kserve"


def test_autoscaler_scales_on_the_queue_and_cpu_only_as_a_fallback() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (kustomize) is needed to apply the overlays' HPA patches")
    (adapter,) = _render("autoscaling")
    served = {
        rule["name"]["as"] for rule in yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    }
    for overlay in ("base", "overlays/cpu", "overlays/gpu"):
        (hpa,) = [d for d in _render(overlay) if d["kind"] == "HorizontalPodAutoscaler"]
        metrics = hpa["spec"]["metrics"]
        pods = {m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"}
        assert "attention_queue_depth_requests" in pods, overlay
        assert pods <= served, f"{overlay}: prometheus-adapter serves no {pods - served}"
        resources = [m["resource"]["name"] for m in metrics if m["type"] == "Resource"]
        assert resources == (["cpu"] if overlay == "overlays/cpu" else []), overlay
