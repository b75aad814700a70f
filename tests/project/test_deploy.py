"""deploy/: the KubeRay RayJob manifest and the container image recipe.

KubeRay's CRDs prune unknown fields without a word (a misspelt `shutdownAfterJobFinish` would just
not shut the cluster down), so the manifest is checked against the fields KubeRay documents
(ray.io/v1 RayJobSpec, RayClusterSpec, HeadGroupSpec, WorkerGroupSpec, AuthOptions: the KubeRay
CRD API reference, docs.ray.io/en/latest/cluster/kubernetes/references/api.html, and
ray-operator/apis/ray/v1/*_types.go), their types and enums, and its entrypoint against this
version's own `litevlm fleet` parser and parameters. Docker cannot run here: the Dockerfile is
checked for what the manifest relies on, not built.
"""

import shlex
from pathlib import Path

import ray
import yaml

from litevlm_runtime.cli import build_parser
from litevlm_runtime.commands.node_params import overrides
from litevlm_runtime.ros.parameters import pipeline_options_from
from litevlm_runtime.ros.params_file import load_node_params

ROOT = Path(__file__).resolve().parents[2]

# KubeRay v1.5/1.6 (ray.io/v1), as documented
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint", "runtimeEnvYAML",
               "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus", "entrypointNumGpus",
               "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend", "schedule"}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
RAYCLUSTER_SPEC = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
                   "headServiceAnnotations", "suspend", "authOptions", "gcsFaultToleranceOptions", "managedBy",
                   "upgradeStrategy"}
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template", "headContainerName"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams", "template",
                "scaleStrategy", "suspend", "idleTimeoutSeconds"}
AUTH_OPTIONS = {"mode": {"disabled", "token"}}


def manifest() -> dict:
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "rayjob.yaml").read_text()) if d]
    assert len(docs) == 1
    return docs[0]


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_the_rayjob_has_only_fields_kuberay_documents():
    job = manifest()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"].replace("-", "").isalnum() and len(job["metadata"]["name"]) <= 63
    spec = job["spec"]
    assert set(spec) <= RAYJOB_SPEC, set(spec) - RAYJOB_SPEC
    assert spec["submissionMode"] in SUBMISSION_MODES
    assert isinstance(spec["shutdownAfterJobFinishes"], bool)
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        assert isinstance(spec[key], int) and spec[key] >= 0
    assert isinstance(yaml.safe_load(spec["runtimeEnvYAML"]), dict)         # a YAML string, as KubeRay wants it
    cluster = spec["rayClusterSpec"]
    assert set(cluster) <= RAYCLUSTER_SPEC, set(cluster) - RAYCLUSTER_SPEC
    assert cluster["rayVersion"] == ray.__version__ == "2.60.0"              # the pinned Ray, the image's
    assert set(cluster["authOptions"]) <= set(AUTH_OPTIONS) and cluster["authOptions"]["mode"] in AUTH_OPTIONS["mode"]
    head = cluster["headGroupSpec"]
    assert set(head) <= HEAD_GROUP and {"rayStartParams", "template"} <= set(head)
    groups = cluster["workerGroupSpecs"]
    assert groups and all(set(g) <= WORKER_GROUP and {"groupName", "rayStartParams", "template"} <= set(g)
                          for g in groups)
    images = set()
    for group in (head, *groups):
        # rayStartParams is map[string]string: a bare number would be refused by the API server
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group["rayStartParams"]
        assert containers(group) and all(c["name"] and c["image"] for c in containers(group))
        images |= {c["image"] for c in containers(group)}
    assert len(images) == 1                                                 # one image, every node
    for g in groups:
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        gpus = int(g["rayStartParams"].get("num-gpus", "0"))
        limits = containers(g)[0]["resources"]["limits"]
        assert int(limits.get("nvidia.com/gpu", 0)) == gpus                 # what Ray is told = what the pod has
        assert int(g["rayStartParams"]["num-cpus"]) <= int(limits["cpu"])


def test_the_entrypoint_is_a_valid_fleet_command_for_this_version():
    spec = manifest()["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["litevlm", "fleet", "regress"]
    args = build_parser().parse_args(argv[1:])
    assert args.out.startswith("s3://") and args.baseline.startswith("s3://") and args.report.startswith("s3://")
    assert all(b.startswith("s3://") for b in args.bags)                  # every node reads them, none mounts them
    params = load_node_params(args.params, overrides(args))               # every --set names a real parameter
    pipeline_options_from(params)                                         # ... with a valid value
    workers = manifest()["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert args.gpus_per_worker <= max(int(g["rayStartParams"].get("num-gpus", "0")) for g in workers)
    assert args.threads <= max(int(g["rayStartParams"]["num-cpus"]) for g in workers)
    mounts = {m["mountPath"] for g in workers for c in containers(g) for m in c.get("volumeMounts", [])}
    assert any(params["model_dir"].startswith(m + "/") for m in mounts)  # the model folder is on every worker
    scratch = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]["LITEVLM_SCRATCH"]
    assert scratch in mounts


def test_the_image_recipe_sets_up_what_the_manifest_runs():
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    lines = [ln for ln in docker.splitlines() if ln and not ln.startswith("#")]
    assert any(ln.startswith("FROM python:") for ln in lines)
    assert "bash scripts/setup.sh" in docker and "PATH=/opt/venv/bin:$PATH" in docker
    assert "litevlm fleet --help" in docker and "ray --version" in docker   # the build fails if either is missing
    assert "wget" in docker                                               # KubeRay's probes
    ignored = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
