"""DP-REC's and DP-FedAvg's central epsilons, and DP-FedAvg's noise calibrated to DP-REC's.

Central: amplified by the server's secret client sampling (with replacement for DP-REC, without
for DP-FedAvg), replace-one neighbours, RDP at privkit's orders with the one-round curve
computed once per event.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from fl_examples.dprec.config import REPLACE_ONE, DPRecConfig
from privkit.accountants import rdp, rules
from privkit.accountants.rec import rec_run_event
from privkit.errors import InvalidParameterError
from privkit.events import (
    GaussianDpEvent,
    SampledWithoutReplacementDpEvent,
    SelfComposedDpEvent,
)

__all__ = ["dprec_central_epsilon", "dpfedavg_central_epsilon", "calibrate_dpfedavg"]


@functools.lru_cache(maxsize=64)
def _curve(atom: Any) -> np.ndarray:
    """RDP of one use of ``atom`` at privkit's orders (replace-one), computed once."""
    return rules.rdp_curve(atom, rdp.ORDERS, REPLACE_ONE)


def _eps(atom: Any, count: int, delta: float) -> float:
    """epsilon of ``count`` uses of ``atom`` (the RDP accountant's conversion, reused curve)."""
    return rdp.epsilon_from_rdp(rdp.ORDERS, count * _curve(atom), delta)[0]


def dprec_central_epsilon(cfg: DPRecConfig, num_clients: int, rounds: int,
                          num_groups: int = 1) -> float:
    """DP-REC's amplified epsilon after ``rounds`` rounds (T |S'| draws at rate 1/N).

    Equal to ``privkit.epsilon(rec_run_event(...), delta, "rdp",
    neighboring_relation=REPLACE_ONE)``; the one-draw curve is computed once.
    """
    if rounds == 0:
        return 0.0
    ev = rec_run_event(noise_multiplier=cfg.stddev / cfg.l2_clip, num_candidates=1 << cfg.bits,
                       population_size=num_clients, messages=rounds * cfg.clients_per_round,
                       num_groups=num_groups)
    return _eps(ev.event, ev.count, cfg.delta)


def _dpfedavg_event(z: float, num_clients: int, k: int, rounds: int) -> Any:
    inner: Any = GaussianDpEvent(z)
    if k < num_clients:
        inner = SampledWithoutReplacementDpEvent(num_clients, k, inner)
    return SelfComposedDpEvent(inner, rounds)


def dpfedavg_central_epsilon(z: float, cfg: DPRecConfig, num_clients: int, rounds: int) -> float:
    """DP-FedAvg's epsilon: ``rounds`` Gaussian sums, sampling without replacement, replace-one."""
    if rounds == 0:
        return 0.0
    ev = _dpfedavg_event(z, num_clients, min(cfg.clients_per_round, num_clients), rounds)
    return _eps(ev.event, ev.count, cfg.delta)


def calibrate_dpfedavg(target: float, cfg: DPRecConfig, num_clients: int) -> float:
    """The smallest z (bisection on log z to 1e-4 relative) whose epsilon after T rounds is
    <= target."""
    lo, hi = 1e-2, 1.0
    while dpfedavg_central_epsilon(hi, cfg, num_clients, cfg.rounds) > target:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise InvalidParameterError("epsilon", target, "reachable by DP-FedAvg")
    while math.log(hi / lo) > 1e-4:
        mid = math.sqrt(lo * hi)
        if dpfedavg_central_epsilon(mid, cfg, num_clients, cfg.rounds) <= target:
            hi = mid
        else:
            lo = mid
    return hi
