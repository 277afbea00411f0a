"""The Dockerfile, deploy/compose.yaml and deploy/kubernetes/ against the real ``serve`` CLI.

Offline and without Docker or a cluster: every ``radixmesh serve`` command line they build
(the image's entrypoint plus the Compose ``command`` / Kubernetes ``args``) must use flags that
exist exactly (argparse would also accept an abbreviation) and parse into a valid
:class:`ServeConfig`; the orchestrators' kill timeouts must exceed ``--drain-grace``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from radixmesh.runtime import serve_cli
from radixmesh.runtime.config import ServeConfig, config_from_args, parse_duration

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
PORT = 8000
MIN_KEY_BYTES = 16


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixmesh serve", allow_abbrev=False)
    serve_cli.add_arguments(parser)  # what `radixmesh serve` itself uses
    return parser


def _serve_config(argv: list[str]) -> ServeConfig:
    """The config of ``radixmesh serve ARGV``, after checking each flag is spelled exactly."""
    parser = _parser()
    known = set(parser._option_string_actions)
    used = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert used <= known, f"not flags of radixmesh serve: {sorted(used - known)}"
    return config_from_args(parser.parse_args(argv))


def _dockerfile() -> dict[str, str]:
    """Last value of each instruction (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out[word.upper()] = rest.strip()
    return out


def _entrypoint() -> list[str]:
    entry: list[str] = json.loads(_dockerfile()["ENTRYPOINT"])
    assert entry[:2] == ["radixmesh", "serve"]
    return entry[2:]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


def _k8s() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _k8s() if d["kind"] == kind]


def _statefulset_container() -> dict[str, Any]:
    (sts,) = _kind("StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args; every referenced variable must be defined."""
    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_entrypoint_default_cmd_and_healthcheck() -> None:
    ins = _dockerfile()
    assert ins["FROM"] == "${BASE_IMAGE}" and "ARG BASE_IMAGE=python:3.11-slim" in (
        ROOT / "Dockerfile").read_text()
    config = _serve_config([*_entrypoint(), *json.loads(ins["CMD"])])
    assert (config.host, config.port, config.advertise) == ("0.0.0.0", PORT, f"127.0.0.1:{PORT}")
    assert ins["EXPOSE"] == str(PORT) and ins["STOPSIGNAL"] == "SIGTERM"
    assert ins["USER"].split(":")[0] not in ("0", "root")
    assert f"127.0.0.1:{PORT}/health" in ins["HEALTHCHECK"] and "curl" not in ins["HEALTHCHECK"]
    text = (ROOT / "Dockerfile").read_text()
    # torch from the CPU index, before the package (which would pull a CUDA build otherwise)
    runs = [line for line in text.splitlines() if line.startswith("RUN pip install")]
    assert [r.split()[3].strip('"') for r in runs] == ["torch==${TORCH_VERSION}", "."]
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[0]
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text


def test_binding_everywhere_needs_advertise() -> None:
    with pytest.raises(ValueError, match="--advertise"):
        _serve_config(_entrypoint())  # what a mesh node without --advertise would get


def test_dockerignore_keeps_the_context_small() -> None:
    lines = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs"} <= lines


# -------------------------------------------------------------------------------- Compose


def test_compose_nodes_flags_and_grace() -> None:
    data = _compose()
    services = data["services"]
    assert sorted(services) == ["n1", "n2", "n3", "n4"]
    for i, name in enumerate(sorted(services), start=1):
        svc = services[name]
        config = _serve_config([*_entrypoint(), *svc["command"]])
        assert config.node_id == name
        assert config.advertise == f"{name}:{PORT}"
        assert config.peers == (f"n1:{PORT}",)
        assert svc["ports"] == [f"{8000 + i}:{PORT}"]
        assert parse_duration(svc["stop_grace_period"]) > config.drain_grace
        assert "/health" in " ".join(svc["healthcheck"]["test"])
        key = svc["environment"]["RADIXMESH_CLUSTER_KEY"]
        assert key.startswith("${RADIXMESH_CLUSTER_KEY"), "the key comes from the environment"
        assert "--cluster-key" not in svc["command"]


# ----------------------------------------------------------------------------- Kubernetes


def test_k8s_statefulset_args_parse_with_pod_env() -> None:
    (sts,) = _kind("StatefulSet")
    container = _statefulset_container()
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    sample = {"POD_NAME": "radixmesh-0", "POD_IP": "10.1.2.3", "POD_NAMESPACE": "prod",
              "HOME": "/tmp"}
    assert set(sample) >= {n for n, e in env.items() if "value" in e or "fieldRef" in
                           e.get("valueFrom", {})}
    argv = [_expand(a, sample) for a in container["args"]]
    config = _serve_config([*_entrypoint(), *argv])
    assert config.node_id == "radixmesh-0"
    assert config.advertise == f"10.1.2.3:{PORT}"
    headless = sts["spec"]["serviceName"]
    assert config.join_dns == f"{headless}.prod.svc.cluster.local:{PORT}"
    assert sts["spec"]["replicas"] == 4
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.drain_grace
    assert "--cluster-key" not in container["args"], shlex.join(container["args"])


def test_k8s_headless_service_probes_resources() -> None:
    (sts,) = _kind("StatefulSet")
    services = {s["metadata"]["name"]: s for s in _kind("Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    for svc in services.values():
        assert svc["spec"]["selector"].items() <= labels.items()
    container = _statefulset_container()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health"
        assert named.get(get["port"], get["port"]) == PORT
    live = container["livenessProbe"]
    config = _serve_config([*_entrypoint(), *[_expand(a, {"POD_NAME": "p", "POD_IP": "1.2.3.4",
                                                          "POD_NAMESPACE": "n"})
                                              for a in container["args"]]])
    assert live["periodSeconds"] * live["failureThreshold"] > config.drain_grace
    for part in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][part])


def test_k8s_secret_is_a_placeholder_that_fails_closed() -> None:
    container = _statefulset_container()
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"]
              if e["name"] == "RADIXMESH_CLUSTER_KEY"]
    (secret,) = _kind("Secret")
    assert secret["metadata"]["name"] == ref["name"]
    placeholder = secret["stringData"][ref["key"]]
    assert len(placeholder.encode()) < MIN_KEY_BYTES  # a node refuses to start with it
    with pytest.raises(ValueError, match="16 bytes"):
        ServeConfig(cluster_key=placeholder)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "secret.example.yaml" not in kustomization["resources"]
    for name in kustomization["resources"]:
        assert (K8S / name).is_file()
