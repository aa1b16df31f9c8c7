"""The MIG profiles NVIDIA documents per GPU model (``mig_profiles.yaml`` beside this module,
with its sources), read once: used by the right-sizing advice (rules/rightsize.py) and by the
agent's scheduler collectors, which turn a request for MIG devices into the part of a GPU it is.

A profile's part of a GPU in capacity is its compute slices over the GPU's (1g.10gb on an H100:
1/7), as the agent's MIG instance rows carry it (:attr:`gpuslo.wire.GpuSample.fraction`): a
request for one such slice and a free instance of it are the same amount of GPU, so the
starvation snapshot compares like with like.
"""

from __future__ import annotations

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
    """The part of a GPU one device of MIG ``profile`` is (``1g.10gb``, ``3g.40gb``; a media
    extension ``+me`` is its base profile's), None for a name the table does not list."""
    base = profile.strip().lower().split("+", 1)[0]
    return profile_fractions().get(base)
