"""Kueue on the real control plane: kube-controller-manager (the Job controller, and the garbage
collector that deletes a Job's Workload with it) from the same Kubernetes build as the API server
(provision/k8s.sh), and Kueue's controller manager built from the Go module proxy with its CRDs
and webhook manifests (provision/kueue.sh).

Kueue runs as it would in a cluster, with two differences forced by the machine (no Service
network, no cert-manager):

- its internal certificate management is off (``internalCertManagement.enable: false``): the
  webhook server gets a serving certificate made here for 127.0.0.1 (``webhook.certDir``), and
  the webhook configurations and CRD conversion webhooks from its module are registered with a
  ``url`` clientConfig (``https://127.0.0.1:PORT/PATH``) and that CA, where a cluster has a
  ``service`` reference. Only the webhooks of what is enabled are registered (Kueue's own kinds
  and ``batch/job``): the others would refuse every request of their kinds with failurePolicy
  Fail, since no handler serves them.
- with internal certificate management off, Kueue v0.17.0 reads its metrics serving certificate
  from the fixed path ``/etc/kueue/metrics/certs`` (cmd/kueue/main.go) and exits when it is not
  there. The fixture writes no file outside its directory: Kueue runs in its own mount namespace
  (``unshare -m``) whose ``/etc`` is an overlay holding that certificate.
- the visibility API server (an aggregated API for pending-workload listings, feature
  ``VisibilityOnDemand``) is off: it keeps its certificates under the fixed ``/visibility``, and
  nothing here reads that API (the collector reads Workload objects).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.servers.k8s import ROOT, ApiError, KubeControlPlane
from tests.servers.ports import free_port
from tests.servers.tls import make_certs

KUEUE_NAMESPACE = "kueue-system"
#: CRDs whose kustomization (config/components/crd/kustomization.yaml) adds a conversion webhook
CONVERTED = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
#: API groups whose webhooks the enabled integrations serve (Kueue's own kinds and batch/job)
SERVED_GROUPS = {"kueue.x-k8s.io", "batch"}


def provision() -> Path:
    """The directory holding bin/kueue, crd/ and webhook/ (built once per machine)."""
    r = subprocess.run(["bash", str(ROOT / "provision" / "kueue.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"provision/kueue.sh failed:\n{r.stderr[-4000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def _insecure() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the components' own self-signed serving certificates
    return ctx


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(
        url, timeout=2, context=_insecure() if url.startswith("https") else None
    ) as r:
        return bool(r.status == 200)


class KueueStack:
    def __init__(self, kube: KubeControlPlane, kueue_dir: Path) -> None:
        self.kube = kube
        self.kueue_dir = kueue_dir
        self.dir = kube.dir / "kueue"
        self.kcm_port = free_port()
        self.webhook_port = free_port()
        self.health_port = free_port()
        self.metrics_port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def _wait(self, name: str, ok: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.procs[name]
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}: {self.tail(name)}")
            try:
                if ok():
                    return
            except (OSError, ApiError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready in {timeout_s} s: {self.tail(name)}")
            time.sleep(0.3)

    def tail(self, name: str, n: int = 3000) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def start(self, timeout_s: float = 180.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.kube.dir / "admin.kubeconfig"
        self._spawn("kube-controller-manager", [
            str(self.kube.bin / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            "--controllers=job-controller,garbage-collector-controller", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={self.kcm_port}", "--v=1",
        ])  # fmt: skip
        self._wait("kube-controller-manager", lambda: _healthy(f"https://127.0.0.1:{self.kcm_port}/healthz"),
                   timeout_s)  # fmt: skip
        ca = self._certs()
        self._install_crds(ca)
        self.kube.ensure_namespace(KUEUE_NAMESPACE)
        self._spawn_kueue(kubeconfig)
        self._wait("kueue", lambda: _healthy(f"http://127.0.0.1:{self.health_port}/readyz"), timeout_s)
        self._register_webhooks(ca)

    def _certs(self) -> str:
        tls = self.dir / "tls"
        make_certs(tls, servers=("webhook",))
        serving = self.dir / "serving-certs"
        serving.mkdir(exist_ok=True)
        shutil.copy(tls / "webhook.crt", serving / "tls.crt")
        shutil.copy(tls / "webhook.key", serving / "tls.key")
        metrics = self.dir / "etc-upper" / "kueue" / "metrics" / "certs"
        metrics.mkdir(parents=True, exist_ok=True)
        shutil.copy(tls / "webhook.crt", metrics / "tls.crt")
        shutil.copy(tls / "webhook.key", metrics / "tls.key")

        return base64.b64encode((tls / "ca.pem").read_bytes()).decode()

    def _spawn_kueue(self, kubeconfig: Path) -> None:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise RuntimeError(
                "Kueue v0.17.0 with its internal certificate management off reads its metrics certificate "
                "from /etc/kueue/metrics/certs; this fixture gives it one in a mount namespace of its own, "
                f"which needs CAP_SYS_ADMIN (unshare -m): {probe.stderr.strip()}"
            )
        cfg = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": KUEUE_NAMESPACE, "manageJobsWithoutQueueName": False,
            "internalCertManagement": {"enable": False},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1",
                        "certDir": str(self.dir / "serving-certs")},
            "leaderElection": {"leaderElect": False},
            "integrations": {"frameworks": ["batch/job"]},
        }  # fmt: skip
        (self.dir / "config.yaml").write_text(json.dumps(cfg))
        work = self.dir / "etc-work"
        work.mkdir(exist_ok=True)
        overlay = f"lowerdir=/etc,upperdir={self.dir / 'etc-upper'},workdir={work}"
        kueue = [str(self.kueue_dir / "bin" / "kueue"), f"--config={self.dir / 'config.yaml'}",
                 "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"]  # fmt: skip
        script = 'mount -t overlay overlay -o "$1" /etc && shift && exec "$@"'
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self._spawn("kueue", ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                              overlay, *kueue], env)  # fmt: skip

    # ------------------------------------------------------------------ API objects
    def _install_crds(self, ca: str) -> None:
        for f in sorted((self.kueue_dir / "crd").glob("*.yaml")):
            crd = yaml.safe_load(f.read_text())
            if crd["spec"]["names"]["plural"] in CONVERTED:
                crd["spec"]["conversion"] = {
                    "strategy": "Webhook",
                    "webhook": {"conversionReviewVersions": ["v1"], "clientConfig": {
                        "url": f"https://127.0.0.1:{self.webhook_port}/convert", "caBundle": ca}},
                }  # fmt: skip
            self.kube.api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        for f in sorted((self.kueue_dir / "crd").glob("*.yaml")):
            name = yaml.safe_load(f.read_text())["metadata"]["name"]
            self._wait_established(name)

    def _wait_established(self, name: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            crd = self.kube.api("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conds = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
            if conds.get("Established") == "True":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRD {name} not Established: {conds}")
            time.sleep(0.2)

    def _register_webhooks(self, ca: str) -> None:
        for doc in yaml.safe_load_all((self.kueue_dir / "webhook" / "manifests.yaml").read_text()):
            if not doc:
                continue
            doc = copy.deepcopy(doc)
            kept = []
            for wh in doc.get("webhooks") or []:
                groups = {g for r in wh.get("rules") or [] for g in r.get("apiGroups") or []}
                if not groups <= SERVED_GROUPS:
                    continue
                path = wh["clientConfig"]["service"]["path"]
                wh["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}", "caBundle": ca}
                kept.append(wh)
            doc["webhooks"] = kept
            plural = "mutatingwebhookconfigurations" if doc["kind"].startswith("Mutating") else (
                "validatingwebhookconfigurations")  # fmt: skip
            self.kube.api("POST", f"/apis/admissionregistration.k8s.io/v1/{plural}", doc)

    def stop(self) -> None:
        for name in ("kueue", "kube-controller-manager"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
