"""The GPU overlay does not inherit what only suits CPU pods, and the GPU wheels are pinned."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from service.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "k8s" / "overlays" / "gpu"


def _doc(name: str) -> dict:
    return yaml.safe_load((GPU / name).read_text())


def test_rollout_needs_no_spare_gpu() -> None:
    strategy = _doc("deployment-patch.yaml")["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}


def test_autoscaler_scales_on_the_queue_to_a_few_gpus() -> None:
    config = yaml.safe_load((GPU / "kustomization.yaml").read_text())
    assert {"path": "hpa-patch.yaml"} in config["patches"]
    hpa = _doc("hpa-patch.yaml")["spec"]
    assert hpa["maxReplicas"] <= 4
    assert [m["type"] for m in hpa["metrics"]] == ["Pods"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "attention_queue_depth_requests"
    assert hpa["behavior"]["scaleUp"]["policies"][0]["value"] == 1


def test_runtime_class_is_documented_and_ready_to_enable() -> None:
    text = (GPU / "kustomization.yaml").read_text()
    assert "# - path: runtimeclass-patch.yaml" in text
    pod = _doc("runtimeclass-patch.yaml")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"


def test_gpu_settings_in_the_overlay_exist() -> None:
    container = _doc("deployment-patch.yaml")["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert set(env) <= {env_name(name) for name in Settings.__dataclass_fields__}
    assert env["ATTENTION_CUDA_TF32"] == "off"


def test_gpu_constraints_pin_every_nvidia_wheel_and_name_cublas() -> None:
    pins = dict(
        re.findall(r"^([a-z0-9-]+)==([0-9.]+)$", (ROOT / "constraints-gpu.txt").read_text(), re.M)
    )
    assert pins["onnxruntime-gpu"] == "1.31.1"
    assert "nvidia-cublas" in pins
    for wheel in (
        "nvidia-cuda-runtime",
        "nvidia-cuda-nvrtc",
        "nvidia-cudnn-cu13",
        "nvidia-cufft",
        "nvidia-curand",
        "nvidia-nvjitlink",
    ):
        assert wheel in pins, wheel
