"""Private runs: the privacy plan of each algorithm, its calibration and the releases each
client will make (client sampling comes from the seed tree)."""

from __future__ import annotations

from typing import Any

from fl_examples.core.data import FederatedDataset
from fl_examples.core.privacy import (
    PrivacyPlan,
    calibrate,
)
from fl_examples.core.rounds import (
    sample_clients,
    straggler_epochs,
)
from fl_examples.core.seeds import SeedTree
from fl_examples.upcycled.config import UpcycledConfig
from privkit.errors import InvalidParameterError


def planned_releases(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset,
                     iterations: int) -> list[int]:
    """Releases each client will make in a run (client sampling comes from the seed tree)."""
    tree = SeedTree(cfg.seed)
    rounds = (iterations + 1) // 2 if algorithm == "upcycled" else iterations
    counts = [0] * ds.num_clients
    for r in range(1, rounds + 1):
        sel = sample_clients(tree, r, ds.num_clients, cfg.fraction)
        _, strag = straggler_epochs(tree, r, len(sel), cfg.stragglers, cfg.local_epochs)
        for c in (sel[~strag] if algorithm == "fedavg" else sel):
            counts[int(c)] += 1
    return counts


def _plan_for(cfg: UpcycledConfig, ds: FederatedDataset, algorithm: str,
              noise: float | None = None) -> PrivacyPlan:
    stddev = noise if (noise is not None and cfg.privacy == "output") else cfg.stddev
    alpha = noise if (noise is not None and cfg.privacy == "objective") else cfg.alpha
    return PrivacyPlan(
        kind=cfg.privacy, sizes=tuple(int(n) for n in ds.train_sizes),
        l2_clip_norm=cfg.l2_clip_norm, stddev=stddev, sensitivity=cfg.sensitivity, alpha=alpha,
        proximal_mu=0.0 if algorithm == "fedavg" else cfg.mu, lipschitz_model=cfg.lipschitz_bound,
        batch_size=cfg.batch_size, momentum=cfg.momentum, allow_unproven=cfg.allow_unproven,
        glm=cfg.model == "logreg")


def _privacy_plan(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
                  ) -> tuple[PrivacyPlan | None, dict[str, Any]]:
    if cfg.privacy == "none":
        return None, {}
    if cfg.privacy == "objective" and algorithm == "fedavg":
        raise InvalidParameterError("compare", "fedavg",
                                    "not combined with objective perturbation (it needs mu > 0)")
    if cfg.noise_for_epsilon is None:
        return _plan_for(cfg, ds, algorithm), {}
    counts = planned_releases(algorithm, cfg, ds, iterations)
    x, eps = calibrate(lambda v: _plan_for(cfg, ds, algorithm, v), counts,
                       target=cfg.noise_for_epsilon, delta=cfg.delta,
                       statistic=cfg.noise_target,
                       larger_is_more_private=cfg.privacy == "output")
    info = {"calibrated": {"parameter": "stddev" if cfg.privacy == "output" else "alpha",
                           "value": x, "target_epsilon": cfg.noise_for_epsilon,
                           "statistic": cfg.noise_target, "planned_epsilon": eps}}
    return _plan_for(cfg, ds, algorithm, x), info
