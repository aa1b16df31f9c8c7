"""Throw-away TLS material for test servers, made with the openssl command line."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certs(d: Path, servers: tuple[str, ...] = ("server",), clients: tuple[str, ...] = ()) -> None:
    """In ``d``: ca.pem/ca.key (a CA valid two days); NAME.crt/NAME.key signed by it for each
    server (subjectAltName 127.0.0.1 and localhost) and client; NAME.p8 (the key as PKCS#8)."""
    d.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        r = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {r.stderr[-2000:]}")

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=gpuslo test CA")  # fmt: skip
    for name in servers + clients:
        ext = "subjectAltName=IP:127.0.0.1,DNS:localhost" if name in servers else "basicConstraints=CA:FALSE"
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=gpuslo-{name}")  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext")  # fmt: skip
        openssl("pkcs8", "-topk8", "-nocrypt", "-in", f"{name}.key", "-out", f"{name}.p8")
