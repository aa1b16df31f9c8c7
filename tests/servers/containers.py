"""The container back-end: a server's container as data (:class:`Spec`, unit-tested without an
engine), and :class:`Container`, which runs a spec through testcontainers.

Every container runs on the host's network (``network_mode=host``), so a server in a container
listens on the same 127.0.0.1 ports, with the same configuration files, as its local process
would: the fixtures' objects (``port``, ``bootstrap``, ``url``) and the tests' bodies are the
same on both back-ends, and a server in a container reaches the tests' own receivers on
127.0.0.1. That needs a Linux Docker engine (or Docker Desktop 4.34+ with host networking
turned on). testcontainers is imported only when a container starts: choosing a back-end and
building a spec need neither it nor an engine."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    mode: str = "ro"


@dataclass(frozen=True)
class Spec:
    image: str
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    user: str | None = None  # uid:gid, where the server writes into a mounted host directory
    ulimits: tuple[tuple[str, int, int], ...] = ()  # (name, soft, hard)
    network_mode: str = "host"

    def run_kwargs(self) -> dict[str, Any]:
        """What docker's ``containers.create`` gets beyond the image, command, env and volumes."""
        kw: dict[str, Any] = {"network_mode": self.network_mode}
        if self.user is not None:
            kw["user"] = self.user
        if self.ulimits:
            kw["ulimits"] = [{"name": n, "soft": s, "hard": h} for n, s, h in self.ulimits]
        return kw


class Container:
    """One container of ``spec``: :meth:`start` creates and starts it the first time, and starts the
    same container again after :meth:`stop` or :meth:`kill` (its own filesystem, and so a server's
    data, survives as a process's data directory does); :meth:`close` removes it."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self._tc: Any = None

    def start(self) -> None:
        if self._tc is not None:
            self._tc.get_wrapped_container().start()
            return
        from testcontainers.core.container import DockerContainer  # type: ignore[import-not-found, unused-ignore]

        c = DockerContainer(self.spec.image).with_kwargs(**self.spec.run_kwargs())
        for k, v in self.spec.env.items():
            c = c.with_env(k, v)
        for m in self.spec.mounts:
            c = c.with_volume_mapping(str(m.source), m.target, m.mode)
        if self.spec.command:
            c = c.with_command(list(self.spec.command))
        c.start()
        self._tc = c

    def running(self) -> bool:
        if self._tc is None:
            return False
        w = self._tc.get_wrapped_container()
        w.reload()
        return bool(w.status == "running")

    def logs(self, n: int = 3000) -> str:
        if self._tc is None:
            return ""
        out, err = self._tc.get_logs()
        return str((out + err).decode(errors="replace"))[-n:]

    def stop(self, timeout_s: int = 30) -> None:
        if self._tc is not None:
            self._tc.get_wrapped_container().stop(timeout=timeout_s)

    def kill(self) -> None:
        if self._tc is not None:
            self._tc.get_wrapped_container().kill()

    def close(self) -> None:
        if self._tc is not None:
            try:
                self._tc.stop()  # testcontainers' stop: remove, with its volumes
            except Exception as exc:  # cleanup: Ryuk removes what is left at exit
                log.warning("removing container %s failed: %s", self.spec.image, exc)
            self._tc = None
