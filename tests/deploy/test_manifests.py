"""deploy/kubernetes: every core object is valid against the Kubernetes API schema
(``kubernetes-validate``, which ships the schemas: no cluster needed), the ConfigMap's policy is
one the proxy accepts, the probes hit the proxy's health routes, and the KubeRay RayCluster's pod
templates are valid pod templates with a GPU worker group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.policy import WorkerBackend, parse_policy

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
VERSION = "1.30.0"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, VERSION, strict=True)


def test_the_proxy_objects_are_valid_and_wired() -> None:
    docs = {d["kind"]: d for d in documents("pacer.yaml")}
    assert set(docs) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    for obj in docs.values():
        validate(obj)
    policy = parse_policy(__import__("tomllib").loads(docs["ConfigMap"]["data"]["policy.toml"]), "<configmap>")
    assert policy.fleet.backend is WorkerBackend.RAY and [p.name for p in policy.pools] == ["llama-70b", "llama-8b"]
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["command"][-1] == "/etc/pacer/policy.toml"
    # the state volume is where the policy's default paths (.pacer/...) resolve: the image's WORKDIR
    (workdir,) = [
        line.split()[1]
        for line in (DEPLOY.parents[1] / "Dockerfile").read_text().splitlines()
        if line.startswith("WORKDIR ")
    ]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["state"] == f"{workdir}/.pacer" and str(policy.control.journal_path).startswith(".pacer/")
    assert policy.batch.dir.parts[0] == ".pacer" and all(p.engine.log_dir.parts[0] == ".pacer" for p in policy.pools)
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]  # endpoints drop it first
    grace = docs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 5 + policy.proxy.shutdown_grace_s + 30  # the drain and the workers' stop fit after it
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]


def test_three_replicas_share_the_store_and_roll_one_at_a_time() -> None:
    """Several replicas, never all down at once: a rolling update (not Recreate) and a disruption
    budget below the replicas; the store's url from a Secret, the policy naming its variable."""
    docs = {d["kind"]: d for d in documents("pacer.yaml")}
    spec = docs["Deployment"]["spec"]
    assert spec["replicas"] == 3 and spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = docs["PodDisruptionBudget"]["spec"]
    assert 0 < budget["minAvailable"] < spec["replicas"]
    assert budget["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    policy = parse_policy(__import__("tomllib").loads(docs["ConfigMap"]["data"]["policy.toml"]), "<configmap>")
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert policy.store.url == "" and policy.store.url_env in env  # no url in the ConfigMap: the Secret's
    assert env[policy.store.url_env]["valueFrom"]["secretKeyRef"] == {"name": "pacer-store", "key": "url"}


def test_the_ray_policy_passes_the_checks_serve_makes(tmp_path, capsys) -> None:
    """On Ray, `gpus = "auto"` is Ray's accounting (tp GPUs a worker, on the node it picks), not
    NVML's on the proxy's host: serve's placement check must not refuse it (it did: "auto" needs
    NVML to see the GPUs)."""
    from proxy.cli import _check_placement, main

    (config,) = [d for d in documents("pacer.yaml") if d["kind"] == "ConfigMap"]
    path = tmp_path / "policy.toml"
    path.write_text(config["data"]["policy.toml"])
    policy = parse_policy(__import__("tomllib").loads(path.read_text()), str(path))
    assert all(p.auto_gpus for p in policy.pools)
    assert _check_placement(policy, final=True) == {}
    assert main(["check-policy", str(path)]) == 0, capsys.readouterr().err


def test_a_broken_object_is_refused() -> None:
    (deployment,) = [d for d in documents("pacer.yaml") if d["kind"] == "Deployment"]
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def test_the_raycluster_has_valid_pod_templates_and_a_gpu_worker_group() -> None:
    (cluster,) = documents("raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    templates = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    for template in templates:  # KubeRay's templates are core PodTemplateSpecs
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})
    (group,) = spec["workerGroupSpecs"]
    gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == group["rayStartParams"]["num-gpus"] == "8"
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    ports = {p["containerPort"] for p in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert 10001 in ports  # the Ray client port the proxy attaches to
