"""DP-REC's and DP-FedAvg's central epsilons, and the noise of each calibrated to a target.

Central: amplified by the server's secret client sampling.

* DP-REC: T |S'| draws with replacement at rate 1/N, each a REC message, replace-one (the
  only relation its bound is proven under), RDP at privkit's orders with the one-draw curve
  computed once per event (:mod:`privkit.accountants.rec`).
* DP-FedAvg: T rounds of :class:`privkit.ClientLevelGaussian` (each client's update clipped
  to C, one N(0, (z C)^2) draw on the sum) on a Poisson sample at rate q, priced by
  :func:`privkit.epsilon` under the run's relation. The event is the mechanism's own,
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, under either relation (z = stddev / C);
  under replace-one the accountant applies the sum's sensitivity 2C.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import privkit
from fl_examples.dprec.config import (
    REPLACE_ONE,
    DPRecConfig,
    relation_of,
)
from privkit.accountants import rdp, rules
from privkit.accountants.calibration import _solve_noise
from privkit.accountants.rec import rec_run_event
from privkit.errors import InvalidParameterError
from privkit.events import SelfComposedDpEvent
from privkit.mechanisms.aggregate import ClientLevelGaussian

__all__ = ["dprec_central_epsilon", "calibrate_dprec", "dpfedavg_round_event",
           "dpfedavg_central_epsilon", "calibrate_dpfedavg"]


@functools.lru_cache(maxsize=64)
def _curve(atom: Any) -> np.ndarray:
    """RDP of one use of ``atom`` at privkit's orders (replace-one), computed once."""
    return rules.rdp_curve(rules.relative_to_sensitivity(atom, REPLACE_ONE), rdp.ORDERS,
                           REPLACE_ONE)


def _eps(atom: Any, count: int, delta: float) -> float:
    """epsilon of ``count`` uses of ``atom`` (the RDP accountant's conversion, reused curve)."""
    return rdp.epsilon_from_rdp(rdp.ORDERS, count * _curve(atom), delta)[0]


def dprec_central_epsilon(cfg: DPRecConfig, num_clients: int, rounds: int,
                          num_groups: int = 1, stddev: float | None = None) -> float:
    """DP-REC's amplified epsilon after ``rounds`` rounds (T |S'| draws at rate 1/N), with
    ``stddev`` (default ``cfg.stddev``).

    Equal to ``privkit.epsilon(rec_run_event(...), delta, "rdp",
    neighboring_relation=REPLACE_ONE)``; the one-draw curve is computed once.
    """
    if rounds == 0:
        return 0.0
    cfg = cfg.resolved(("dprec",), check=False)
    sigma = cfg.stddev if stddev is None else stddev
    ev = rec_run_event(noise_multiplier=sigma / cfg.l2_clip, num_candidates=1 << cfg.bits,
                       population_size=num_clients,
                       messages=rounds * cfg.draws_per_round(num_clients), num_groups=num_groups)
    return _eps(ev.event, ev.count, cfg.delta)


def calibrate_dprec(target: float, cfg: DPRecConfig, num_clients: int,
                    num_groups: int = 1) -> float:
    """The smallest stddev sigma (to 1e-3 relative; the safe end, evaluated) whose central
    epsilon after ``cfg.rounds`` rounds is <= ``target``: privkit's noise solver (Illinois
    regula falsi on log sigma against log epsilon) on :func:`dprec_central_epsilon` itself.

    Raises:
        InvalidParameterError: naming ``epsilon``: the target is below what any sigma reaches
            (the with-replacement bound has a floor that grows with T |S'| / N^2).
    """
    target = float(target)
    cfg = cfg.resolved(("dprec",), check=False)
    cap = 1e3 * cfg.l2_clip

    def eps_of(sigma: float) -> float:
        e = dprec_central_epsilon(cfg, num_clients, cfg.rounds, num_groups, sigma)
        if sigma >= cap and e > target:
            raise InvalidParameterError(
                "epsilon", target, f"reachable by DP-REC (its central epsilon stays above "
                f"{e:.3g} at stddev {sigma / cfg.l2_clip:.3g} x --clip with these rounds, "
                "draws and clients: fewer rounds or draws, or more clients)")
        return e

    return float(_solve_noise(eps_of, target, 1e-3, cfg.stddev)[0])


def dpfedavg_round_event(z: float, client_rate: float, relation: Any) -> Any:
    """One DP-FedAvg round: :class:`privkit.ClientLevelGaussian`'s event, the same under
    either relation (price it under ``relation``: replace-one doubles the sensitivity)."""
    return ClientLevelGaussian(1.0, z, client_rate).event(relation)  # clip cancels in z


@functools.lru_cache(maxsize=1024)
def _dpfedavg_eps(z: float, q: float, relation: Any, rounds: int, delta: float) -> float:
    ev = SelfComposedDpEvent(dpfedavg_round_event(z, q, relation), rounds)
    return privkit.epsilon(ev, delta, neighboring_relation=relation).epsilon


def dpfedavg_central_epsilon(z: float, cfg: DPRecConfig, num_clients: int, rounds: int) -> float:
    """DP-FedAvg's epsilon after ``rounds`` Poisson-sampled rounds, under the run's relation
    (:func:`privkit.epsilon`, the default method: the smallest valid bound)."""
    if rounds == 0:
        return 0.0
    return _dpfedavg_eps(float(z), cfg.client_rate_for(num_clients),
                         relation_of(cfg, "dpfedavg"), int(rounds), float(cfg.delta))


def calibrate_dpfedavg(target: float, cfg: DPRecConfig, num_clients: int) -> float:
    """The smallest z (to 1e-4 relative) whose epsilon after T rounds is <= target."""
    q, rel = cfg.client_rate_for(num_clients), relation_of(cfg, "dpfedavg")
    try:
        z, _, _ = privkit.calibrate_noise(
            lambda x: SelfComposedDpEvent(dpfedavg_round_event(x, q, rel), cfg.rounds),
            target_epsilon=float(target), delta=cfg.delta, tol=1e-4, neighboring_relation=rel)
    except InvalidParameterError as exc:
        raise InvalidParameterError("epsilon", target, "reachable by DP-FedAvg") from exc
    while dpfedavg_central_epsilon(z, cfg, num_clients, cfg.rounds) > target:
        z *= 1 + 1e-5  # the safe side of the solver's tolerance
    return float(z)


