"""The container and Kubernetes files (Dockerfile, deploy/kubernetes/) checked without a Docker
engine or a cluster: the image's command line and the pods' arguments parse with `jaxbatch
serve`'s own parser, everything the Dockerfile copies exists and is not ignored, the probes
reach /health on the port the server listens on, selectors and ports agree between the
Deployment and the Service, and the autoscaler's query names a metric /metrics exports with the
model name the pods serve under."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex

import yaml

from jaxbatch.cli.serve import build_parser
from jaxbatch.server.metrics import ServerMetrics
from tests.helpers import REPO

KUBE = os.path.join(REPO, "deploy", "kubernetes")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    with open(os.path.join(REPO, "Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", f.read())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def manifests() -> dict[str, dict]:
    docs = {}
    for name in sorted(os.listdir(KUBE)):
        with open(os.path.join(KUBE, name)) as f:
            for doc in yaml.safe_load_all(f):
                assert doc["kind"] not in docs, doc["kind"]
                docs[doc["kind"]] = doc
    return docs


def serve_args(extra: list[str]) -> tuple[list[str], object]:
    ops = dict(dockerfile())
    entry = json.loads(ops["ENTRYPOINT"])
    assert entry[:2] == ["jaxbatch", "serve"], entry
    argv = entry[2:] + extra
    return argv, build_parser().parse_args(argv)


def test_dockerfile_runs_the_server_on_its_exposed_port():
    ops = dockerfile()
    names = [op for op, _ in ops]
    assert names[0] == "FROM" and "python:3.1" in ops[0][1]
    cmd = json.loads(dict(ops)["CMD"])
    argv, args = serve_args(cmd)
    assert args.host == "0.0.0.0"
    assert str(args.port) in dict(ops)["EXPOSE"].split()
    assert os.path.isfile(os.path.join(REPO, args.config)), args.config
    # the health check and the package install
    assert f"127.0.0.1:{args.port}/health" in dict(ops)["HEALTHCHECK"]
    assert any(op == "RUN" and "pip install" in rest and " ." in rest for op, rest in ops)


def test_dockerfile_copies_what_exists_and_is_not_ignored():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        ignored = [p.strip() for p in f if p.strip() and not p.startswith("#")]
    copied = []
    for op, rest in dockerfile():
        if op == "COPY":
            copied += shlex.split(rest)[:-1]
    assert copied
    for src in copied:
        assert os.path.exists(os.path.join(REPO, src)), src
        assert not any(fnmatch.fnmatch(src, pat) for pat in ignored), src
    # the package's sources and its kernels' sources are in the image
    for needed in ("jaxbatch", "pallas_kernels", "pyproject.toml"):
        assert needed in copied


def test_deployment_probes_ports_and_selectors_agree():
    docs = manifests()
    dep, svc = docs["Deployment"], docs["Service"]
    assert dep["apiVersion"] == "apps/v1" and svc["apiVersion"] == "v1"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    _, args = serve_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == args.port
    for port in svc["spec"]["ports"]:
        assert ports.get(port["targetPort"], port["targetPort"]) == args.port
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["JAXBATCH_CACHE"] == mounts["cache"]
    assert {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]} == set(mounts)
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_autoscaler_queries_an_exported_metric_of_the_served_model():
    docs = manifests()
    dep, scaler = docs["Deployment"], docs["ScaledObject"]
    assert scaler["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    _, args = serve_args(container["args"])
    (trigger,) = scaler["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    m = re.search(r"(vllm:[a-z_]+)\{model_name=\"([^\"]+)\"\}", query)
    assert m, query
    metric, model = m.groups()
    assert model == args.served_model_name[0]
    exported = ServerMetrics(model).render().decode()
    assert re.search(rf"^{re.escape(metric)}\{{model_name=\"{model}\"\}} ", exported, re.M), metric
    assert float(trigger["metadata"]["threshold"]) > 0
    assert 1 <= scaler["spec"]["minReplicaCount"] <= scaler["spec"]["maxReplicaCount"]


def test_pods_read_their_key_from_the_secret_and_refuse_an_empty_one(tmp_path):
    """The key reaches the server as a file from the Secret jaxbatch-api-key; the shipped Secret
    holds none, and a pod given an empty key file refuses to start (nothing serves keyless)."""
    import pytest

    from jaxbatch.cli.serve import api_key_from_args

    docs = manifests()
    dep, secret = docs["Deployment"], docs["Secret"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    _, args = serve_args(container["args"])
    assert args.api_key is None and args.api_key_file
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    (name,) = [n for n, v in volumes.items() if "secret" in v]
    src = volumes[name]["secret"]
    assert src["secretName"] == secret["metadata"]["name"]
    (item,) = src["items"]
    assert os.path.join(mounts[name], item["path"]) == args.api_key_file
    assert item["key"] in secret["stringData"]
    empty = tmp_path / "api-key"
    empty.write_text(secret["stringData"][item["key"]])
    with pytest.raises(SystemExit, match="holds no key"):
        api_key_from_args(build_parser().parse_args(["--api-key-file", str(empty)]), {})


def test_cache_is_a_persistent_claim_and_kustomize_names_the_image():
    docs = manifests()
    dep, claim, kust = docs["Deployment"], docs["PersistentVolumeClaim"], docs["Kustomization"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every replica mounts it
    # kustomize applies files that exist (the Secret left out: re-applying would reset the key)
    for f in kust["resources"]:
        assert os.path.isfile(os.path.join(KUBE, f)), f
    assert "secret.yaml" not in kust["resources"]
    (image,) = kust["images"]
    assert image["name"] == container["image"]
    # the image build is documented with the name kustomize expects
    with open(os.path.join(REPO, "deploy", "README.md")) as f:
        readme = f.read()
    assert f"docker build -t {image['newName']}:{image['newTag']} ." in readme
