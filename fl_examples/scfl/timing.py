"""SCFL's simulated timing: compute, retransmitted uploads and the arrival probabilities.

A client's epoch time is ``t_i(b) = b n_mac / MACR_i + N_i tau_u,i + t_d`` with ``N_i``
geometric retransmissions (erasure probability ``p_l,i``); it arrives iff ``t_i <= T``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_examples.core.seeds import SeedTree
from fl_examples.scfl.config import ScflConfig
from privkit import _validate

__all__ = ["TimingModel", "arrival_probability"]


@dataclass(frozen=True)
class TimingModel:
    """t_i(b) = b n_mac / macr_i + N_i tau_u,i + t_d, N_i ~ Geometric(1 - erasure_i) >= 1.

    Attributes (seconds, MACs, MAC/s): n_mac per sample; macr (per client); macr_server;
    tau_u (one upload attempt, per client); erasure (p_l,i); t_down.
    """

    n_mac: float
    macr: np.ndarray
    macr_server: float
    tau_u: np.ndarray
    erasure: np.ndarray
    t_down: float

    def compute_time(self, batch: Any) -> np.ndarray:
        return np.asarray(batch, dtype=np.float64) * self.n_mac / self.macr

    def server_time(self, batch: int) -> float:
        return float(batch) * self.n_mac / self.macr_server

    def min_time(self, batch: Any) -> np.ndarray:
        """The fastest possible t_i(b): one upload attempt."""
        return self.compute_time(batch) + self.tau_u + self.t_down

    def arrival_probability(self, deadline: float, batch: Any) -> np.ndarray:
        """Closed form p_i(T, b) = 1 - p_l^k, k = floor((T - t_c - t_d)/tau_u), 0 if k < 1."""
        k = self.max_attempts(_validate.positive("deadline", deadline), batch)
        return np.where(k >= 1, 1.0 - self.erasure ** np.maximum(k, 1.0), 0.0)

    def max_attempts(self, deadline: float, batch: Any) -> np.ndarray:
        """k_i: the most upload attempts that still meet the deadline (may be <= 0)."""
        return np.floor((deadline - self.compute_time(batch) - self.t_down) / self.tau_u)

    def draw_attempts(self, rng: np.random.Generator) -> np.ndarray:
        """N_i for every client: geometric number of upload attempts (>= 1)."""
        return rng.geometric(1.0 - self.erasure)

    def times(self, batch: Any, attempts: np.ndarray) -> np.ndarray:
        return self.compute_time(batch) + attempts * self.tau_u + self.t_down


def arrival_probability(deadline: float, compute_s: Any, upload_s: Any, download_s: float,
                        erasure: Any) -> np.ndarray:
    """p_i(T, b) from explicit times (see :meth:`TimingModel.arrival_probability`)."""
    tm = TimingModel(1.0, 1.0 / np.asarray(compute_s, dtype=np.float64), 1.0,
                     np.asarray(upload_s, dtype=np.float64),
                     np.asarray(erasure, dtype=np.float64), float(download_s))
    return tm.arrival_probability(deadline, 1.0)


def _timing(cfg: ScflConfig, n: int, dim: int, outputs: int) -> TimingModel:
    rng = SeedTree(cfg.seed).numpy(0, "timing")
    u_c, u_u, u_e = rng.random(n), rng.random(n), rng.random(n)
    params = dim * outputs * cfg.bits_per_param
    return TimingModel(
        n_mac=float(cfg.n_mac if cfg.n_mac is not None else 2 * dim * outputs),
        macr=cfg.mac_rate * cfg.compute_spread ** (-u_c),
        macr_server=float(cfg.server_mac_rate),
        tau_u=params / (cfg.uplink_rate * cfg.uplink_spread ** (-u_u)),
        erasure=cfg.erasure_min + (cfg.erasure_max - cfg.erasure_min) * u_e,
        t_down=params / cfg.downlink_rate)
