"""Private runs: the privacy plan of each algorithm, its calibration and the releases each
client will make (client sampling comes from the seed tree)."""

from __future__ import annotations

from typing import Any

import privkit
from fl_examples.core.data import FederatedDataset
from fl_examples.core.dp_modes import ClientDpPlan, RecordDpPlan, calibrate_record
from fl_examples.core.dpsgd import DpSgdSettings, steps_per_client
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
from privkit.mechanisms.aggregate import AdaptiveClipping, ClientLevelGaussian


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


def data_rounds(algorithm: str, iterations: int) -> int:
    return (iterations + 1) // 2 if algorithm == "upcycled" else iterations


def client_plan(cfg: UpcycledConfig, ds: FederatedDataset, z: float | None = None
                ) -> ClientDpPlan:
    q = cfg.effective_client_rate
    adaptive = None if cfg.adaptive_clip is None else AdaptiveClipping(
        cfg.adaptive_clip, learning_rate=0.2, count_stddev=max(q * ds.num_clients / 20, 1e-3),
        sampling_probability=q)
    return ClientDpPlan(ds.num_clients, q, cfg.l2_clip_norm,
                        cfg.noise_multiplier if z is None else z, server_lr=cfg.server_lr,
                        server_momentum=cfg.server_momentum, adaptive=adaptive)


def record_plan(cfg: UpcycledConfig, ds: FederatedDataset, z: float | None = None
                ) -> RecordDpPlan:
    return RecordDpPlan(tuple(int(n) for n in ds.train_sizes), DpSgdSettings(
        cfg.l2_clip_norm, cfg.noise_multiplier if z is None else z, cfg.batch_size))


def planned_steps(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset,
                  iterations: int) -> list[int]:
    """DP-SGD steps each client will run in the whole run (``record``)."""
    tree = SeedTree(cfg.seed)
    steps = [0] * ds.num_clients
    sizes = ds.train_sizes
    for r in range(1, data_rounds(algorithm, iterations) + 1):
        sel = sample_clients(tree, r, ds.num_clients, cfg.fraction)
        epochs, strag = straggler_epochs(tree, r, len(sel), cfg.stragglers, cfg.local_epochs)
        if algorithm == "fedavg":
            sel, epochs = sel[~strag], epochs[~strag]
        for c, s in zip(sel, steps_per_client(sizes[sel], epochs, cfg.batch_size).tolist()):
            steps[int(c)] += int(s)
    return steps


def _dp_plan(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
             ) -> tuple[Any, dict[str, Any]]:
    """The client- or record-level plan, with ``noise_for_epsilon`` calibrated."""
    if cfg.noise_for_epsilon is None:
        plan = client_plan(cfg, ds) if cfg.privacy == "client" else record_plan(cfg, ds)
        return plan, {}
    target, d = cfg.noise_for_epsilon, cfg.delta
    if cfg.privacy == "client":
        rounds = data_rounds(algorithm, iterations)
        base = client_plan(cfg, ds)
        extra = [] if base.adaptive is None else [
            privkit.SelfComposedDpEvent(base.adaptive.event(), rounds)]
        z, eps, _ = privkit.calibrate_noise(
            lambda x: privkit.ComposedDpEvent(
                [privkit.SelfComposedDpEvent(ClientLevelGaussian(
                    base.l2_clip_norm, x, base.client_rate).event(), rounds), *extra]),
            target_epsilon=target, delta=d, tol=1e-4)
        plan: Any = client_plan(cfg, ds, z)
    else:
        steps = planned_steps(algorithm, cfg, ds, iterations)
        z, eps = calibrate_record(steps, list(ds.train_sizes), target=target, delta=d,
                                  statistic=cfg.noise_target, batch_size=cfg.batch_size)
        plan = record_plan(cfg, ds, z)
    return plan, {"calibrated": {"parameter": "noise_multiplier", "value": z,
                                 "target_epsilon": target, "statistic": cfg.noise_target
                                 if cfg.privacy == "record" else "population",
                                 "planned_epsilon": eps}}


def _privacy_plan(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
                  ) -> tuple[Any, dict[str, Any]]:
    if cfg.privacy == "none":
        return None, {}
    if cfg.privacy in ("client", "record"):
        return _dp_plan(algorithm, cfg, ds, iterations)
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
