"""Deployment files: systemd units verified by systemd-analyze; Kubernetes manifests parsed
and checked against the CLI and the agent's defaults."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslo.app.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((ROOT / "deploy/systemd").glob("*.service"))


def _exec_start(unit: Path) -> list[str]:
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    return line.split("=", 1)[1].split()


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_verifies_and_its_command_parses(unit: Path, tmp_path: Path) -> None:
    argv = _exec_start(unit)
    assert argv[0] == "/usr/local/bin/gpuslo"
    args = build_parser().parse_args(argv[1:])
    assert callable(args.func)
    if args.cmd == "agent" and "--metrics-port" in argv:  # scraped from elsewhere: all interfaces, explicitly
        assert args.metrics_addr == "0.0.0.0"
    if args.cmd == "agent" and args.source == "nvml":
        assert args.slurm and args.pool == ""  # the pool comes from sinfo
    text = unit.read_text()
    for hardening in (
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "User=gpuslo",
        "Restart=always",
        "CapabilityBoundingSet=",
    ):
        assert hardening in text, hardening
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    # verify a copy whose ExecStart points at an executable that exists here
    copy = tmp_path / unit.name
    copy.write_text(text.replace("/usr/local/bin/gpuslo", shutil.which("true") or "/bin/true"))
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)], capture_output=True, text=True, check=False
    )
    problems = [x for x in r.stderr.splitlines() if unit.name in x or "Unknown" in x or "Invalid" in x]
    assert r.returncode == 0 and not problems, r.stderr


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_daemonset_least_privilege_mounts_probes_and_command() -> None:
    docs = _docs(ROOT / "deploy/kubernetes/agent-daemonset.yaml")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = build_parser().parse_args(c["args"])
    assert args.source == "nvml" and args.metrics_port == 9400
    # probes and Prometheus reach /metrics at the pod IP: all interfaces, said explicitly
    assert args.metrics_addr == "0.0.0.0" and build_parser().parse_args(["agent"]).metrics_addr == "127.0.0.1"
    # the node is the Node (not the pod's host name), and its pool comes from the Node's labels
    assert args.node == "$(NODE_NAME)" and args.pool == ""
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuslo-agent")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    assert args.k8s_pod_resources and args.k8s_resource_slices  # DRA devices resolved to UUIDs
    binding = next(
        d for d in docs if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == "gpuslo-agent"
    )
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuslo-agent", "namespace": "gpuslo"}]
    assert {p["containerPort"] for p in c["ports"]} == {args.metrics_port}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert mounts["pod-resources"]["readOnly"] is True
    assert (
        vols["pod-resources"]["hostPath"]["path"]
        == mounts["pod-resources"]["mountPath"]
        == "/var/lib/kubelet/pod-resources"
    )
    assert mounts["spool"]["mountPath"] == args.spool_dir
    # shared GPUs: the host's /proc (NVML gives host pids) and the pod log directories, read-only
    assert (
        args.proc_root == mounts["host-proc"]["mountPath"]
        and vols["host-proc"]["hostPath"]["path"] == "/proc"
    )
    assert args.pod_log_dir == mounts["pod-logs"]["mountPath"] == vols["pod-logs"]["hostPath"]["path"]
    assert mounts["host-proc"]["readOnly"] is True and mounts["pod-logs"]["readOnly"] is True
    assert "hostPID" not in pod  # not needed: the host's pids are read through /host/proc
    cfg = next(d for d in docs if d["kind"] == "ConfigMap")
    from gpuslo.core.settings import ServiceConfig

    svc = ServiceConfig.model_validate(yaml.safe_load(cfg["data"]["service.yaml"]))
    assert str(svc.spool.directory) == args.spool_dir
    assert (
        pod["serviceAccountName"]
        == next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    )


def test_collector_deployment_and_least_privilege_rbac() -> None:
    docs = _docs(ROOT / "deploy/kubernetes/collector.yaml")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(c["args"])
    assert args.source == "k8s-events" and args.state_file.startswith("/var/lib/gpuslo/")
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices", "resourceclaims", "resourceclaimtemplates"],
         "verbs": ["get", "list", "watch"]},
    ]  # fmt: skip
    assert not args.no_k8s_dra  # GPUs requested through claims are counted
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"][0]["name"] == sa and binding["roleRef"]["name"] == role["metadata"]["name"]
    pod_sc = dep["spec"]["template"]["spec"]["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize(
    "manifest", sorted((ROOT / "deploy/kubernetes").glob("*.yaml")), ids=lambda p: p.name
)
def test_agent_workloads_run_the_slim_agent_image(manifest: Path) -> None:
    """Every container running `gpuslo agent` uses the image of the Dockerfile's agent stage
    (gpuslo[agent] only); anything else the full one."""
    for doc in _docs(manifest):
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        for c in (pod or {}).get("containers", []):
            agent = c["args"][0] == "agent"
            assert c["image"].startswith("gpuslo-agent:" if agent else "gpuslo:"), (manifest.name, c["image"])


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit_says_to_install_the_extra_it_runs(unit: Path) -> None:
    role = _exec_start(unit)[1]
    extra = {"agent": "agent", "ingest": "ingest", "rules": "rules"}[role]
    # from the checkout, as the Dockerfile installs: no index is asked for a distribution named gpuslo
    assert f"pip install -c constraints.txt '.[{extra}]'" in unit.read_text()


def _agent_command_lines() -> list[tuple[str, list[str]]]:
    """Every ``gpuslo agent ...`` the project ships or shows: the systemd units, the Kubernetes
    manifests, docker-compose.yml, and each one in the README and docs (a shell line or a code
    span naming a --source; ``...`` and a trailing comment left out)."""
    import re
    import shlex

    out: list[tuple[str, list[str]]] = []
    for unit in UNITS:
        argv = _exec_start(unit)
        if argv[1] == "agent":
            out.append((unit.name, argv[2:]))
    for path in [*sorted((ROOT / "deploy/kubernetes").glob("*.yaml")), ROOT / "docker-compose.yml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            for c in _containers(doc):
                argv = c.get("args") or c.get("command") or []
                if argv[:1] == ["agent"]:
                    out.append((path.name, argv[1:]))
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"gpuslo agent((?: +--?[a-z0-9][^`\n#|]*)?)", md.read_text()):
            words = [w for w in shlex.split(m.group(1)) if w != "..."]
            if "--source" not in words:  # a flag named in prose (`gpuslo agent --out`), not a command
                continue
            out.append((f"{md.name}: gpuslo agent{m.group(1).rstrip()}", words))
    return out


def _containers(doc: Any) -> list[dict[str, Any]]:
    """The containers of a Kubernetes workload, or the services of a compose file."""
    if not isinstance(doc, dict):
        return []
    if "services" in doc:
        return [s for s in doc["services"].values() if isinstance(s, dict)]
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return list(spec.get("containers", []))


def test_every_agent_command_shipped_or_shown_is_one_the_agent_takes() -> None:
    """A flag the agent would ignore is refused (gpuslo/app/flag_rules.py): no unit, manifest
    or page may show a command line it refuses."""
    from gpuslo.app.flag_rules import AGENT as RULES
    from gpuslo.app.flag_rules import refusals, typed

    lines = _agent_command_lines()
    assert len(lines) >= 20 and {"gpuslo-agent.service", "agent-daemonset.yaml", "docker-compose.yml"} <= {
        where for where, _ in lines
    }
    for where, argv in lines:
        a = build_parser().parse_args(["agent", *argv])
        assert refusals(a.source, typed(build_parser(), ["agent", *argv], ("agent",), RULES)) == [], where


def test_every_shipped_command_passes_the_ignored_flags_check() -> None:
    """docker-compose.yml's commands, the units' and the manifests' (ingest and rules run too):
    none is refused for a flag its run would ignore (gpuslo/app/flag_rules.py)."""
    from gpuslo.app.cli import _refused
    from gpuslo.app.flag_rules import AGENT, refusals, typed

    argvs = [_exec_start(u)[1:] for u in UNITS]
    for path in [*sorted((ROOT / "deploy/kubernetes").glob("*.yaml")), ROOT / "docker-compose.yml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            argvs += [
                c.get("args") or c.get("command")
                for c in _containers(doc)
                if c.get("args") or c.get("command")
            ]
    argvs = [a for a in argvs if isinstance(a, list) and a and not a[0].startswith("-")]
    assert {a[0] for a in argvs} >= {"agent", "ingest", "rules"}, argvs
    for argv in argvs:
        a = build_parser().parse_args(argv)
        assert _refused(a, argv) is None, argv
        if argv[0] == "agent":
            assert refusals(a.source, typed(build_parser(), argv, ("agent",), AGENT)) == [], argv


# ----------------------------------------------------------------------------- time to stop
def _stop_bound_s(argv: list[str]) -> float:
    """How long the command may take between SIGTERM and its exit, from its own bounds: the
    agent's last delivery (``--flush-timeout-s``), the ingest's write in flight, commit and
    leaving the group, the rules service's reclaim command in flight and its delivery deadline."""
    from gpuslo.ingest.kafka_consumer import CLOSE_TIMEOUT_MS, COMMIT_TIMEOUT_MS, STOP_WRITE_GRACE_S
    from gpuslo.rules.reclaim_config import ReclaimAction

    args = build_parser().parse_args(argv)
    if args.cmd == "agent":
        return float(args.flush_timeout_s) if args.kafka else 5.0
    if args.cmd == "ingest":
        return STOP_WRITE_GRACE_S + (COMMIT_TIMEOUT_MS + CLOSE_TIMEOUT_MS) / 1000
    assert args.cmd == "rules", argv
    return float(ReclaimAction().timeout_s) + float(args.delivery_deadline_s)


def _systemd_span_s(text: str) -> float:
    """A systemd time span in seconds (``90``, ``90s``, ``1min 30s``, ``infinity``)."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "ms": 0.001}
    if text.strip() == "infinity":
        return float("inf")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    assert parts and "".join(n + u for n, u in parts) == text.replace(" ", ""), text
    return sum(float(n) * units[u] for n, u in parts)


def test_a_systemd_span_reads_as_systemd_reads_it() -> None:
    assert [_systemd_span_s(t) for t in ("90", "90s", "1min 30s", "2min", "500ms")] == [90, 90, 90, 120, 0.5]


def _shipped_stops() -> list[tuple[str, list[str], float]]:
    """(where, the command, the seconds it is given between SIGTERM and the kill) for every
    long-running gpuslo process shipped: systemd units (TimeoutStopSec, systemd's default 90 s),
    Kubernetes pods (terminationGracePeriodSeconds, 30 s unless set) and compose services
    (stop_grace_period, 10 s unless set)."""
    out: list[tuple[str, list[str], float]] = []
    for unit in UNITS:
        # TimeoutSec= sets the stop's time too, and the last line of the two wins; a unit that
        # sets neither gets the host's DefaultTimeoutStopSec= (90 s as systemd ships, which a
        # host's system.conf may lower), so each unit writes its own (the collector's had none,
        # and a TimeoutSec=20 was read as 90 s)
        spans = [
            x.split("=", 1)[1]
            for x in unit.read_text().splitlines()
            if x.startswith(("TimeoutStopSec=", "TimeoutSec="))
        ]
        assert spans, f"{unit.name}: no TimeoutStopSec="
        out.append((unit.name, _exec_start(unit)[1:], _systemd_span_s(spans[-1])))
    for manifest in sorted((ROOT / "deploy/kubernetes").glob("*.yaml")):
        for doc in _docs(manifest):
            pod = doc.get("spec", {}).get("template", {}).get("spec")
            for c in (pod or {}).get("containers", []):
                out.append(
                    (
                        f"{manifest.name}:{c['name']}",
                        c["args"],
                        float(pod.get("terminationGracePeriodSeconds", 30)),
                    )
                )
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if svc.get("image", "").startswith("gpuslo"):
            grace = str(svc.get("stop_grace_period", "10s"))
            assert grace.endswith("s") and grace[:-1].isdigit(), grace  # whole seconds, as written here
            out.append((f"docker-compose.yml:{name}", svc["command"], float(grace[:-1])))
    return out


def test_every_shipped_process_is_given_the_time_its_stop_takes() -> None:
    """SIGTERM starts a stop that takes up to the command's own bounds; the kill must not come
    before (Kubernetes' default 30 s and compose's 10 s cut the agent's 60 s last delivery short)."""
    stops = _shipped_stops()
    assert {a[0] for _, a, _ in stops} == {"agent", "ingest", "rules"}  # every kind is looked at
    short = [f"{where}: {grace:g} s for a stop of up to {_stop_bound_s(argv):g} s"
             for where, argv, grace in stops if grace < _stop_bound_s(argv) + 10]  # fmt: skip
    assert not short, short
