"""deploy/: the image and the Kubernetes manifests agree with the server they run (flags, port, probes, drain)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from live_server import http_get, live_server

from server.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def server_container() -> dict:
    (container,) = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_the_image_runs_the_server_with_valid_flags_on_the_exposed_port():
    instructions = dockerfile()
    entry = json.loads(next(a for i, a in instructions if i == "ENTRYPOINT"))
    cmd = json.loads(next(a for i, a in instructions if i == "CMD"))
    exposed = int(next(a for i, a in instructions if i == "EXPOSE"))
    assert entry[:4] == ["python", "-m", "server", "serve"]
    parser = build_parser()
    image_default = parser.parse_args(entry[3:] + cmd)
    assert image_default.host == "0.0.0.0" and image_default.port == exposed
    # Kubernetes `args` replace CMD and keep ENTRYPOINT.
    container = server_container()
    deployed = parser.parse_args(entry[3:] + container["args"])
    assert deployed.port == exposed == container["ports"][0]["containerPort"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert deployed.model in mounts and image_default.model in mounts


def test_the_image_installs_what_the_server_needs_and_runs_unprivileged():
    instructions = dockerfile()
    runs = " ".join(a for i, a in instructions if i == "RUN")
    assert "libopus0" in runs and '".[server]"' in runs and "dashscope==2.0.2" in runs
    copied = {src for i, a in instructions if i == "COPY" for src in a.split()[:-1]}
    assert {"engine", "server", "voicelane_wire", "client_demo", "pyproject.toml", "README.md"} <= copied
    user = next(a for i, a in instructions if i == "USER")
    assert user not in ("0", "root")
    assert manifests()["Deployment"]["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user)
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert "**/.venv" in ignored and ".git" in ignored


def test_one_gpu_per_pod_and_the_service_reaches_it():
    docs = manifests()
    container = server_container()
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 == resources["requests"]["nvidia.com/gpu"]
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for selector in (docs["Service"]["spec"]["selector"], docs["Deployment"]["spec"]["selector"]["matchLabels"],
                     docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    port_names = {p["name"] for p in container["ports"]}
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] in port_names
    annotations = docs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == container["ports"][0]["containerPort"]


def test_termination_grace_covers_the_pause_and_the_drain():
    container = server_container()
    drain = build_parser().parse_args(["serve", *container["args"]]).drain_timeout_s
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = manifests()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pause + drain + 5


def test_probes_use_endpoints_that_behave_as_the_manifests_assume(tiny_checkpoint):
    container = server_container()
    assert container["startupProbe"]["httpGet"]["path"] == container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    server = live_server(tiny_checkpoint, "default")
    status, _, body = http_get(server.http_url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = http_get(server.http_url + "/ready")
    assert status == 200 and json.loads(body)["ready"] is True
    # (and 503 while draining: tests/test_server_drain.py)
