"""The MIG profiles NVIDIA documents per GPU model (``mig_profiles.yaml`` beside this module,
with its sources), read once: used by the right-sizing advice (rules/rightsize.py) and by the
agent's scheduler collectors, which turn a request for MIG devices into the part of a GPU it is.

A profile's part of a GPU in capacity is its compute slices over the GPU's (1g.10gb on an H100:
1/7), as the agent's MIG instance rows carry it (:attr:`gpuslo.wire.GpuSample.fraction`): a
request for one such slice and a free instance of it are the same amount of GPU, so the
starvation snapshot compares like with like.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict, Field

from gpuslo.core.yamlfile import load_model

PROFILES_FILE = Path(__file__).with_name("mig_profiles.yaml")


class TableError(ValueError):
    pass


class _M(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelEntry(_M):
    """One GPU model of the table: its pattern on the NVML/DCGM name, documented memory, slices
    and profiles (name -> [compute slices, memory slices])."""

    name: str
    match: str
    memory_gb: float = Field(gt=0)
    compute_slices: int = Field(ge=1, le=8)
    memory_slices: int = Field(ge=1, le=8)
    profiles: dict[str, tuple[int, int]]


class Table(_M):
    models: tuple[ModelEntry, ...]


@cache
def table() -> Table:
    """``mig_profiles.yaml``, read once."""
    return load_model(PROFILES_FILE, Table, TableError)


@cache
def profile_fractions() -> Mapping[str, float]:
    """Profile name (lower case) -> its compute slices over its GPU's, for the names whose part
    every model listing them agrees on (all of NVIDIA's today: 1g.10gb is 1/7 wherever it is,
    1g.6gb 1/4 on an A30)."""
    seen: dict[str, set[float]] = {}
    for m in table().models:
        for name, (compute, _memory) in m.profiles.items():
            seen.setdefault(name.lower(), set()).add(compute / m.compute_slices)
    return MappingProxyType({k: next(iter(v)) for k, v in seen.items() if len(v) == 1})


def gpu_fraction(profile: str) -> float | None:
    """The part of a GPU one device of MIG ``profile`` is, None for a name the table does not
    list. The profile is read as schedulers spell it (:data:`_PROFILE`): NVIDIA's ``1g.10gb`` in
    any case; after the GPU's name, as Slurm's ``AutoDetect=nvml`` types its MIG gres
    (``nvidia_h100_80gb_hbm3_3g.40gb``, ``a100_1g.5gb``); with a media or graphics extension,
    its base profile's, as NVIDIA writes it (``1g.10gb+me``) or the device plugin advertises it
    (``nvidia.com/mig-1g.10gb.me``: a resource name has no ``+``); a compute instance
    ``1c.3g.40gb`` as its compute slices (1/7). (Only ``1g.10gb`` and ``+me`` were read: a
    request for such a device was a whole GPU.)"""
    m = _PROFILE.search(profile.strip().lower())
    if m is None:
        return None
    f = profile_fractions().get(m[2])
    if f is None or m[1] is None:
        return f
    compute, slices = int(m[1]), int(m[2].split("g.", 1)[0])
    return f * compute / slices if 0 < compute <= slices else None


# a MIG profile at the end of a name: an optional compute instance's ``Nc.``, the GPU instance
# profile ``Ng.Mgb`` (after the start or a separator: ``a100_1g.5gb``, not ``11g.5gb``), and any
# extensions (``+me``, ``.me``, ``-me``, ``+gfx``, ``+me.all``)
_PROFILE = re.compile(
    r"(?:^|[^0-9a-z])(?:([0-9]{1,2})c\.)?([0-9]{1,2}g\.[0-9]{1,4}gb)(?:[+.\-][a-z]+)*$", re.ASCII
)
