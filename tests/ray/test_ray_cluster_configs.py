"""The shipped cluster configs: Ray's own validator for the launcher YAML, structure for KubeRay.

No cloud is contacted: ``prepare_config`` only merges Ray's bundled AWS
defaults, and ``validate_config`` checks the result against Ray's JSON schema.
"""

import copy
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("jsonschema")
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
#: The image the cluster files run: the repository's Dockerfile, pushed to the user's registry.
IMAGE = "REGISTRY/loomray:0.1.0"


def _load(name):
    return yaml.safe_load((CLUSTER / name).read_text())


def _env(container):
    return {e["name"]: e for e in container.get("env", [])}


# --- cluster/aws.yaml ------------------------------------------------------------

def test_aws_launcher_config_passes_rays_validation():
    config = _load("aws.yaml")
    validate_config(prepare_config(copy.deepcopy(config)))
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]


def test_aws_launcher_config_rejects_a_typo():
    # The validator is real: the same file with an unknown top-level key fails.
    config = _load("aws.yaml")
    config["max_wrokers"] = 3
    with pytest.raises(Exception, match="max_wrokers"):
        validate_config(prepare_config(config))


def test_aws_wiring_store_credentials_and_supervisor():
    config = _load("aws.yaml")
    setup = "\n".join(config["setup_commands"])
    assert "export LOOMRAY_STORE=s3://" in setup
    assert "pip install" not in setup and config["docker"]["image"] == IMAGE  # loomray comes in the image
    # Credentials come from instance profiles, never from the file.
    assert "AWS_SECRET_ACCESS_KEY" not in (CLUSTER / "aws.yaml").read_text()
    for node_type in config["available_node_types"].values():
        assert node_type["node_config"]["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::")
    head = " ".join(config["head_start_ray_commands"])
    assert "ray start --head" in head
    assert "loomray supervise" in head and "$LOOMRAY_STORE" in head
    assert "loomray supervise" not in " ".join(config["worker_start_ray_commands"])


# --- cluster/kuberay.yaml --------------------------------------------------------

def test_kuberay_manifest_is_a_raycluster_with_head_and_workers():
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay.yaml").read_text()) if d]
    clusters = [d for d in docs if d.get("kind") == "RayCluster"]
    assert len(clusters) == 1
    rc = clusters[0]
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    assert spec["rayVersion"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    groups = spec["workerGroupSpecs"]
    assert groups and all(g["groupName"] and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] for g in groups)
    for container in [head] + [g["template"]["spec"]["containers"][0] for g in groups]:
        env = _env(container)
        assert env["LOOMRAY_STORE"]["value"].startswith("s3://")
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = env[key]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "loomray-s3" and ref["key"] == key
            assert "value" not in env[key]  # never a literal credential
        script = container["args"][0]
        assert "pip install" not in script and container["image"] == IMAGE  # loomray comes in the image
        assert "$KUBERAY_GEN_RAY_START_CMD" in script
    # The custom command is only honoured with this annotation.
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    # The supervisor runs as a sidecar container of the head pod, never in Ray's container or on workers.
    sidecar = spec["headGroupSpec"]["template"]["spec"]["containers"][1]
    assert sidecar["image"] == IMAGE and "exec loomray supervise" in sidecar["args"][0]
    assert "loomray supervise" not in head["args"][0]
    assert all("loomray supervise" not in g["template"]["spec"]["containers"][0]["args"][0] for g in groups)


def test_kuberay_scripts_are_valid_shell():
    rc = _load("kuberay.yaml")
    spec = rc["spec"]
    containers = spec["headGroupSpec"]["template"]["spec"]["containers"] + [
        g["template"]["spec"]["containers"][0] for g in spec["workerGroupSpecs"]]
    for container in containers:
        assert container["command"][:2] == ["/bin/bash", "-lc"]
        # bash -n parses without running anything.
        check = subprocess.run(["bash", "-n", "-c", container["args"][0]], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


# --- secure by default, sessions placed, supervise not fatal -----------------------

def test_aws_runs_a_pinned_image_with_token_auth_and_the_dashboard_on_loopback():
    config = _load("aws.yaml")
    assert config["docker"]["image"] == IMAGE  # the Dockerfile's: a known Ray and Python, loomray installed
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}
    setup = "\n".join(config["setup_commands"])
    assert "export RAY_AUTH_MODE=token" in setup
    # The token travels as a file from the launching machine, never in the file or the store.
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    assert "RAY_AUTH_TOKEN=" not in (CLUSTER / "aws.yaml").read_text()
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    assert """--resources '{"loomray_session": 1}'""" in head  # adopted sessions never land on the head


def test_kuberay_has_token_auth_structured_resources_and_a_head_that_outlives_supervise():
    rc = _load("kuberay.yaml")
    spec = rc["spec"]
    assert spec["authOptions"] == {"mode": "token", "secretName": "loomray-ray-auth"}
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"  # the dashboard is not public
    assert spec["headGroupSpec"]["resources"] == {"CPU": "0"} and "num-cpus" not in spec["headGroupSpec"]["rayStartParams"]
    group = spec["workerGroupSpecs"][0]
    assert group["resources"] == {"loomray_session": "200"} and "resources" not in group["rayStartParams"]
    ray_head, sidecar = spec["headGroupSpec"]["template"]["spec"]["containers"]
    # Ray is the head container's only process; supervise is a container of its own that Kubernetes
    # restarts when it exits, so its failing never restarts the head.
    assert ray_head["args"][0].rstrip().splitlines()[-1].strip() == "exec $KUBERAY_GEN_RAY_START_CMD"
    assert """--resources '{"loomray_session": 1}'""" in sidecar["args"][0]
    env = _env(sidecar)
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "loomray-ray-auth", "key": "auth_token"}
    assert env["LOOMRAY_ALLOW_AGENTS"]["value"]


# --- cluster/kuberay-rayjob.yaml -------------------------------------------------------

def test_rayjob_runs_submit_wait_with_placement_on_a_token_cluster_it_shuts_down():
    job = _load("kuberay-rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    # The job's status is the run's: `submit --wait` exits non-zero unless the run completed.
    entry = spec["entrypoint"]
    assert entry.startswith("loomray submit --wait ") and """--resources '{"loomray_session": 1}'""" in entry
    assert "--store s3://" in entry  # spelled out: the submitter's shell has no $LOOMRAY_STORE
    assert spec["shutdownAfterJobFinishes"] is True
    assert yaml.safe_load(spec["runtimeEnvYAML"])["working_dir"].startswith("s3://")
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "loomray-ray-auth"}
    assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert cluster["headGroupSpec"]["resources"] == {"CPU": "0"}  # sessions never on the head
    pods = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]] + [
        g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    for container in pods:
        env = _env(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "loomray-ray-auth", "key": "auth_token"}
        assert container["image"] == IMAGE and "pip install" not in container["args"][0]
        check = subprocess.run(["bash", "-n", "-c", container["args"][0]], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert container["args"][0].rstrip().splitlines()[-1].strip() == "exec $KUBERAY_GEN_RAY_START_CMD"
    group = cluster["workerGroupSpecs"][0]
    assert group["resources"] == {"loomray_session": "200"} and group["minReplicas"] >= 2


# --- Dockerfile -------------------------------------------------------------------------

def _dockerfile() -> tuple[str, list[list[str]]]:
    """The Dockerfile's base image (its ARG default) and its COPY instructions' sources."""
    text = (ROOT / "Dockerfile").read_text()
    base = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG RAY_IMAGE="))
    copies = [line.split()[2:-1] for line in text.splitlines() if line.startswith("COPY ")]
    return base, copies


def test_dockerfile_builds_on_the_ray_the_clusters_name():
    base, _ = _dockerfile()
    versions = {_load("kuberay.yaml")["spec"]["rayVersion"],
                _load("kuberay-rayjob.yaml")["spec"]["rayClusterSpec"]["rayVersion"]}
    assert versions == {"2.60.0"} and base == "rayproject/ray:2.60.0-py311"


def test_dockerfile_copies_exactly_what_builds_the_package(tmp_path):
    # No Docker daemon here: build what the image's RUN step builds (the wheel, without dependencies)
    # from exactly the files its COPY lines and .dockerignore let into the build context.
    import shutil
    import sys
    import zipfile

    _, copies = _dockerfile()
    context = tmp_path / "src"
    context.mkdir()
    for sources in copies:
        for name in sources:
            src = ROOT / name
            assert src.exists(), f"the Dockerfile copies {name}, which the repository does not have"
            if src.is_dir():
                shutil.copytree(src, context / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(src, context / name)
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert {p for c in copies for p in c} <= allowed
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                          "-w", str(tmp_path / "wheel"), str(context)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    wheel = next((tmp_path / "wheel").glob("loomray-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "loomray/cli/main.py" in names and "loomray/storage/store.py" in names and "loomray/py.typed" in names
    # The storage layer is installed as loomray.storage only: no top-level package a user's folder could shadow.
    assert "loomray/storage/py.typed" in names and not any(n.startswith("storage/") for n in names)
