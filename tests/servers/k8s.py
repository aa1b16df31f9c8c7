"""A real Kubernetes control plane for the integration tests: etcd, kube-apiserver and
kube-scheduler built from the Go module proxy by provision/k8s.sh, on free loopback ports.

No kubelet runs here: nodes are API objects this fixture creates with ``nvidia.com/gpu``
capacity (no node-lifecycle controller runs either, so nothing marks them NotReady), the real
scheduler binds pods to them or leaves them Unschedulable with its own reasons, and a test
plays the kubelet where it needs to (pod phase through ``pods/status``).

The API server runs in the style of controller-runtime's envtest: RBAC authorization, a static
token file with one ``system:masters`` token, service-account tokens signed with a key made
here, the ServiceAccount admission plugin off. Its watch cache is off (``--watch-cache=false``)
so that watches are served by etcd and a compaction gives a real 410 Gone at once; with the
cache on, the API server answers 410 when a version falls out of its cache window instead.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.servers.ports import free_port
from tests.servers.tls import make_certs
from tests.servers.tool import run_tool

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "gpuslo-test-admin-token"


def provision() -> Path:
    """The directory holding etcd, kube-apiserver and kube-scheduler (built once per machine)."""
    r = subprocess.run(["bash", str(ROOT / "provision" / "k8s.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"provision/k8s.sh failed:\n{r.stderr[-4000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


class ApiError(RuntimeError):
    def __init__(self, code: int, body: str) -> None:
        super().__init__(f"HTTP {code}: {body[:500]}")
        self.code = code


class KubeControlPlane:
    def __init__(self, workdir: Path, bin_dir: Path) -> None:
        self.dir = workdir
        self.bin = bin_dir
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.api_port = free_port()
        self.scheduler_port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ctx: ssl.SSLContext | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def ca_file(self) -> Path:
        return self.dir / "tls" / "ca.pem"

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        self.procs[name] = subprocess.Popen(
            [str(self.bin / name), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start(self, timeout_s: float = 120.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tls = self.dir / "tls"
        make_certs(tls, servers=("apiserver",))
        self.ctx = ssl.create_default_context(cafile=str(self.ca_file))
        run_tool(["openssl", "genrsa", "-out", str(tls / "sa.key"), "2048"])
        run_tool(["openssl", "rsa", "-in", str(tls / "sa.key"), "-pubout", "-out", str(tls / "sa.pub")])
        (self.dir / "tokens.csv").write_text(f'{ADMIN_TOKEN},gpuslo-admin,uid-admin,"system:masters"\n')
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{self.etcd_peer_port}"
        self._spawn("etcd", [
            "--name", "default", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}", "--log-level", "warn",
            "--unsafe-no-fsync",
        ])  # fmt: skip
        self._wait(lambda: self._etcd_ok(), "etcd", timeout_s)
        self._spawn("kube-apiserver", [
            f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.api_port}", f"--cert-dir={self.dir / 'certs'}",
            f"--tls-cert-file={tls / 'apiserver.crt'}", f"--tls-private-key-file={tls / 'apiserver.key'}",
            "--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={tls / 'sa.pub'}",
            f"--service-account-signing-key-file={tls / 'sa.key'}",
            "--authorization-mode=RBAC", f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--disable-admission-plugins=ServiceAccount", "--watch-cache=false",
            "--enable-priority-and-fairness=false", "--v=1",
        ])  # fmt: skip
        self._wait(lambda: self._ready(), "kube-apiserver", timeout_s)
        kubeconfig = self.write_kubeconfig(self.dir / "admin.kubeconfig", ADMIN_TOKEN)
        self._spawn("kube-scheduler", [
            f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={self.scheduler_port}", "--v=1",
        ])  # fmt: skip
        self._wait(lambda: self._scheduler_ok(), "kube-scheduler", timeout_s)

    def _wait(self, ok: Any, name: str, timeout_s: float) -> None:
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

    def _etcd_ok(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=2) as r:
            return bool(json.load(r).get("health") == "true")

    def _ready(self) -> bool:
        req = urllib.request.Request(
            self.server + "/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=2, context=self.ctx) as r:
            return r.status == 200

    def _scheduler_ok(self) -> bool:
        return self._healthz_ok(self.scheduler_port)

    def _healthz_ok(self, port: int) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the scheduler's own self-signed serving certificate
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2, context=ctx) as r:
            return r.status == 200

    def start_controller_manager(self, controllers: str, timeout_s: float = 120.0) -> None:
        """kube-controller-manager from the same build, running only ``controllers`` (a test asks
        for what it needs, e.g. ``resourceclaim-controller``); stopped with the rest."""
        if "kube-controller-manager" in self.procs:
            return
        kubeconfig = self.dir / "admin.kubeconfig"
        port = free_port()
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", f"--controllers={controllers}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--v=1",
        ])  # fmt: skip
        self._wait(lambda: self._healthz_ok(port), "kube-controller-manager", timeout_s)

    def tail(self, name: str, n: int = 3000) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def stop(self) -> None:
        for name in ("kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()

    def write_kubeconfig(self, path: Path, token: str) -> Path:
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.server,
                                                      "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "u"}}],
        }  # fmt: skip
        path.write_text(json.dumps(cfg))
        return path

    # ------------------------------------------------------------------ API
    def api(self, method: str, path: str, body: Any = None, token: str = ADMIN_TOKEN,
            content_type: str = "application/json") -> Any:  # fmt: skip
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10, context=self.ctx) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None

    def create_node(self, name: str, gpus: int, labels: dict[str, str] | None = None) -> None:
        """A GPU node as a kubelet with the NVIDIA device plugin would register it (Nodes may
        set their status on create). The TaintNodesByCondition admission plugin gives a new node
        the ``node.kubernetes.io/not-ready`` taint; the node-lifecycle controller would lift it
        once the node is Ready, and since none runs here, this does."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        res = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        self.api("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "status": {
                "capacity": res, "allocatable": res,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                "lastHeartbeatTime": now, "lastTransitionTime": now}],
            },
        })  # fmt: skip
        self.api("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}},
                 content_type="application/merge-patch+json")  # fmt: skip

    def ensure_namespace(self, name: str) -> None:
        try:
            self.api(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            )
        except ApiError as exc:
            if exc.code != 409:
                raise

    def create_pod(
        self, ns: str, name: str, gpus: int, selector: dict[str, str] | None = None
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "containers": [{"name": "main", "image": "registry.invalid/infer:1",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
            "terminationGracePeriodSeconds": 0,
        }  # fmt: skip
        if selector:
            spec["nodeSelector"] = selector
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}
        out: dict[str, Any] = self.api("POST", f"/api/v1/namespaces/{ns}/pods", pod)
        return out

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.api("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
        return out

    def delete_pod(self, ns: str, name: str) -> None:
        self.api("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}?gracePeriodSeconds=0")

    def wait_pod(self, ns: str, name: str, scheduled: bool, timeout_s: float = 60.0) -> dict[str, Any]:
        """Until the scheduler bound it (``scheduled``) or marked it Unschedulable."""
        deadline = time.monotonic() + timeout_s
        while True:
            pod = self.get_pod(ns, name)
            conds = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
            c = conds.get("PodScheduled")
            if scheduled and pod["spec"].get("nodeName"):
                return pod
            if not scheduled and c and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return pod
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {ns}/{name} not {'bound' if scheduled else 'Unschedulable'}: {pod}")
            time.sleep(0.2)

    def finish_pod(self, ns: str, name: str, phase: str = "Succeeded") -> None:
        """What the kubelet would report when the container exits."""
        pod = self.get_pod(ns, name)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod["status"]["phase"] = phase
        pod["status"]["containerStatuses"] = [{
            "name": "main", "image": "registry.invalid/infer:1", "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0 if phase == "Succeeded" else 1, "reason": "Completed",
                                     "startedAt": now, "finishedAt": now}},
        }]  # fmt: skip
        self.api("PUT", f"/api/v1/namespaces/{ns}/pods/{name}/status", pod)

    def compact_etcd(self) -> int:
        """Compact etcd at its current revision (through etcd's own gRPC gateway); returns it."""

        def post(path: str, body: dict[str, Any]) -> Any:
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.etcd_port}{path}", data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.load(r)

        rev = int(post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
        post("/v3/kv/compaction", {"revision": str(rev), "physical": True})
        return rev

    def service_account_token(self, ns: str, name: str) -> str:
        """A bound token for a ServiceAccount through the TokenRequest API, as the kubelet mounts it."""
        out = self.api("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token",
                       {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                        "spec": {"expirationSeconds": 3600}})  # fmt: skip
        return str(out["status"]["token"])

    def apply(self, doc: dict[str, Any]) -> None:
        """Create one manifest object (the kinds deploy/kubernetes holds), with strict field
        validation: an unknown or misplaced field is an error, as ``kubectl apply`` reports it."""
        kind, md = doc["kind"], doc["metadata"]
        paths = {
            "Namespace": "/api/v1/namespaces",
            "ServiceAccount": f"/api/v1/namespaces/{md.get('namespace')}/serviceaccounts",
            "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{md.get('namespace')}/rolebindings",
            "Deployment": f"/apis/apps/v1/namespaces/{md.get('namespace')}/deployments",
            "ConfigMap": f"/api/v1/namespaces/{md.get('namespace')}/configmaps",
            "DaemonSet": f"/apis/apps/v1/namespaces/{md.get('namespace')}/daemonsets",
            "PersistentVolumeClaim": f"/api/v1/namespaces/{md.get('namespace')}/persistentvolumeclaims",
        }
        self.api("POST", paths[kind] + "?fieldValidation=Strict", doc)
