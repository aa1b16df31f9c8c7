"""Latency of a simulated inference service: a log-normal whose median and spread
worsen for a while (``SimConfig.degrade_hours``), so the SLO error budget burns."""

from __future__ import annotations

import math

import numpy as np

from gpuslo.agent.sim.fleet import SimConfig


def _lognormal_cdf(x: float, median: float, sigma: float) -> float:
    return 0.5 * (1.0 + math.erf(math.log(x / median) / (sigma * math.sqrt(2.0))))


def bucket_probabilities(bounds_ms: tuple[float, ...], median_ms: float, sigma: float) -> np.ndarray:
    cdf = [_lognormal_cdf(b, median_ms, sigma) for b in bounds_ms] + [1.0]
    p = np.diff(np.array([0.0, *cdf]))
    p = np.clip(p, 0.0, None)
    return np.asarray(p / p.sum())


class LatencyModel:
    NORMAL = (2.0, 0.33)  # median ms, sigma: about 0.3 % of requests above 5 ms
    DEGRADED = (3.5, 0.45)  # about 21 % above 5 ms

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed + 7919)
        self._p_normal = bucket_probabilities(cfg.bounds_ms, *self.NORMAL)
        self._p_degraded = bucket_probabilities(cfg.bounds_ms, *self.DEGRADED)

    def degraded(self, t: float) -> bool:
        lo, hi = self.cfg.degrade_hours
        h = (t - self.cfg.start_ts) / 3600.0
        return lo <= h < hi

    def draw(self, t_end: float, interval_s: float) -> tuple[tuple[int, ...], float]:
        """Per-bucket request counts for the interval ending at ``t_end``, and their sum in ms."""
        p = self._p_degraded if self.degraded(t_end - interval_s / 2) else self._p_normal
        n = int(self.rng.poisson(self.cfg.requests_per_s * interval_s))
        counts = self.rng.multinomial(n, p)
        mids = [
            b / 2 if i == 0 else (self.cfg.bounds_ms[i - 1] + b) / 2 for i, b in enumerate(self.cfg.bounds_ms)
        ]
        mids.append(self.cfg.bounds_ms[-1] * 1.5)
        total_ms = float(np.dot(counts, mids))
        return tuple(int(c) for c in counts), total_ms
