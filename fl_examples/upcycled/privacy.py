"""Private runs: the privacy plan of each algorithm, its calibration and the releases each
client will make (client sampling comes from the seed tree)."""

from __future__ import annotations

from typing import Any

import privkit
from fl_examples.core.banded import banded_plan
from fl_examples.core.data import FederatedDataset
from fl_examples.core.distributed import distributed_plan
from fl_examples.core.dp_modes import (
    ClientDpPlan,
    RecordDpPlan,
    adaptive_count_stddev,
    adaptive_sum_noise,
    calibrate_record,
)
from fl_examples.core.dpsgd import DpSgdSettings, steps_per_client
from fl_examples.core.privacy import (
    PrivacyPlan,
    calibrate,
)
from fl_examples.core.rounds import (
    independent_straggler_epochs,
    sample_clients,
    straggler_epochs,
)
from fl_examples.core.seeds import SeedTree
from fl_examples.core.status import status
from fl_examples.upcycled.config import UpcycledConfig
from privkit.errors import InvalidParameterError
from privkit.mechanisms.aggregate import AdaptiveClipping, ClientLevelGaussian


def selection_epochs(cfg: UpcycledConfig, tree: SeedTree, data_round: int, sel: Any
                     ) -> tuple[Any, Any]:
    """(local epochs, straggler mask) of the sampled clients ``sel`` in ``data_round``.

    Under client- and record-level DP each client's straggling and epochs are drawn on its
    own (:func:`~fl_examples.core.rounds.independent_straggler_epochs`: they never depend on
    who else was sampled); without privacy and for the paper's output and objective
    perturbation, the authors' rule (round(s K) of the K sampled straggle)."""
    if cfg.privacy in ("client", "record"):
        return independent_straggler_epochs(tree, data_round, sel, cfg.stragglers,
                                            cfg.local_epochs)
    return straggler_epochs(tree, data_round, len(sel), cfg.stragglers, cfg.local_epochs)


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
    # a parameter that calibration sets is None in the configuration until then
    stddev, alpha = stddev or 1.0, alpha or 20.0
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
    z = z if z is not None else cfg.noise_multiplier or 1.0  # 1.0: a placeholder to calibrate
    # --adaptive-clip 0: a fixed clip norm; the count's noise: adaptive_count_stddev
    adaptive = None if not cfg.adaptive_clip else AdaptiveClipping(
        cfg.adaptive_clip, learning_rate=0.2,
        count_stddev=adaptive_count_stddev(q * ds.num_clients, z), sampling_probability=q)
    return ClientDpPlan(ds.num_clients, q, cfg.l2_clip_norm, z, server_lr=cfg.server_lr,
                        server_momentum=cfg.server_momentum, adaptive=adaptive)


def record_plan(cfg: UpcycledConfig, ds: FederatedDataset, z: float | None = None
                ) -> RecordDpPlan:
    z = z if z is not None else cfg.noise_multiplier or 1.0  # 1.0: a placeholder to calibrate
    return RecordDpPlan(tuple(int(n) for n in ds.train_sizes), DpSgdSettings(
        cfg.l2_clip_norm, z, cfg.batch_size))


def planned_steps(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset,
                  iterations: int) -> list[int]:
    """DP-SGD steps each client will run in the whole run (``record``)."""
    tree = SeedTree(cfg.seed)
    steps = [0] * ds.num_clients
    sizes = ds.train_sizes
    for r in range(1, data_rounds(algorithm, iterations) + 1):
        sel = sample_clients(tree, r, ds.num_clients, cfg.fraction)
        epochs, strag = selection_epochs(cfg, tree, r, sel)
        if algorithm == "fedavg":
            sel, epochs = sel[~strag], epochs[~strag]
        for c, s in zip(sel, steps_per_client(sizes[sel], epochs, cfg.batch_size).tolist()):
            steps[int(c)] += int(s)
    return steps


def _dp_plan(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
             ) -> tuple[Any, dict[str, Any]]:
    """The client- or record-level plan, with ``noise_for_epsilon`` calibrated."""
    if cfg.privacy == "client" and cfg.mechanism == "bandmf":
        return _banded(algorithm, cfg, ds, iterations)
    if cfg.privacy == "client" and cfg.aggregation == "distributed":
        return _distributed(algorithm, cfg, ds, iterations)
    if cfg.noise_for_epsilon is None:
        plan = client_plan(cfg, ds) if cfg.privacy == "client" else record_plan(cfg, ds)
        return plan, {}
    target, d = cfg.noise_for_epsilon, cfg.delta
    rounds = data_rounds(algorithm, iterations)
    with status(f"calibrating {algorithm}'s z to epsilon {target:g} (delta {d:g}, {rounds} "
                f"data rounds, {cfg.privacy} level)") as line:
        if cfg.privacy == "client":
            base = client_plan(cfg, ds)
            # calibrate the round's Gaussian (z_eff with adaptive clipping: the sum and the
            # count are one release), then the sum's own z from it
            z_round, eps, _ = privkit.calibrate_noise(
                lambda x: privkit.SelfComposedDpEvent(ClientLevelGaussian(
                    base.l2_clip_norm, x, base.client_rate).event(), rounds),
                target_epsilon=target, delta=d, tol=1e-4)
            z = z_round if base.adaptive is None else _sum_noise(base, z_round, target)
            plan: Any = client_plan(cfg, ds, z)
            eps = privkit.epsilon(privkit.SelfComposedDpEvent(plan.round_event(), rounds),
                                  d).epsilon
        else:
            steps = planned_steps(algorithm, cfg, ds, iterations)
            z, eps = calibrate_record(steps, list(ds.train_sizes), target=target, delta=d,
                                      statistic=cfg.noise_target, batch_size=cfg.batch_size)
            plan = record_plan(cfg, ds, z)
        line.done(f"z = {z:.4g} (planned epsilon {eps:.4g})")
    return plan, {"calibrated": {"parameter": "noise_multiplier", "value": z,
                                 "target_epsilon": target, "statistic": cfg.noise_target
                                 if cfg.privacy == "record" else "population",
                                 "planned_epsilon": eps}}


def _banded(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
            ) -> tuple[Any, dict[str, Any]]:
    """Banded MF over the run's data rounds (Upcycled-FL's even iterations are free)."""
    rounds = data_rounds(algorithm, iterations)
    kw = dict(num_clients=ds.num_clients, rounds=rounds, bands=cfg.bands,
              participation=cfg.participation, client_rate=cfg.effective_client_rate,
              groups=cfg.groups, l2_clip_norm=cfg.l2_clip_norm,
              noise_multiplier=cfg.noise_multiplier, noise_for_epsilon=cfg.noise_for_epsilon,
              delta=cfg.delta, server_lr=cfg.server_lr, server_momentum=cfg.server_momentum,
              min_separation=cfg.min_separation)
    what = (f"{algorithm}'s banded MF ({cfg.bands} bands, {cfg.participation}, {rounds} data "
            "rounds)")
    if cfg.noise_for_epsilon is None:
        with status(f"building {what}"):
            return banded_plan(**kw)  # type: ignore[arg-type]
    with status(f"calibrating {what} to epsilon {cfg.noise_for_epsilon:g} (delta "
                f"{cfg.delta:g})") as line:
        plan, cal = banded_plan(**kw)  # type: ignore[arg-type]
        line.done(f"z = {plan.noise_multiplier:.4g} (planned epsilon "
                  f"{cal['calibrated']['planned_epsilon']:.4g})")
    return plan, cal


def _distributed(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
                 ) -> tuple[Any, dict[str, Any]]:
    """Distributed DP with secure aggregation (:mod:`fl_examples.core.distributed`): each
    sampled client adds its own Skellam share; the noise is set by ``--noise-multiplier`` or
    calibrated to ``--noise-for-epsilon`` over the run's data rounds. FedAvg drops its
    stragglers before the sum (a client is in it with probability q (1 - s))."""
    from fl_examples.core.models import num_parameters
    from fl_examples.upcycled.config import _model

    rounds = data_rounds(algorithm, iterations)
    kw = dict(num_clients=ds.num_clients, client_rate=cfg.effective_client_rate,
              l2_clip_norm=cfg.l2_clip_norm, dim=num_parameters(_model(cfg, ds)),
              bits=cfg.bits, rounds=rounds, delta=cfg.delta, min_survivors=cfg.min_survivors,
              colluders=cfg.colluders, noise_multiplier=cfg.noise_multiplier,
              noise_for_epsilon=cfg.noise_for_epsilon, server_lr=cfg.server_lr,
              server_momentum=cfg.server_momentum,
              drop_rate=cfg.stragglers if algorithm == "fedavg" else 0.0,
              dropout_tolerance=cfg.dropout_tolerance)
    what = f"{algorithm}'s distributed DP ({cfg.bits} bits, {rounds} data rounds)"
    if cfg.noise_for_epsilon is None:
        with status(f"building {what}"):
            return distributed_plan(**kw)  # type: ignore[arg-type]
    with status(f"calibrating {what}'s noise shares to epsilon {cfg.noise_for_epsilon:g} "
                f"(delta {cfg.delta:g}, zero-out)") as line:
        plan, cal = distributed_plan(**kw)  # type: ignore[arg-type]
        line.done(f"{plan.noise_per_client:.4g} per client for {plan.min_survivors} "
                  f"survivors, scaled to each cohort (for max(n_min, (1 - f) n) survivors, f "
                  f"{plan.dropout_tolerance:g}), granularity {plan.granularity:.3g} (z "
                  f"{plan.noise_multiplier:.4g}; planned epsilon "
                  f"{cal['calibrated']['planned_epsilon']:.4g})")
    return plan, cal


def _sum_noise(plan: ClientDpPlan, joint: float, target: float) -> float:
    """The sum's z giving the round the calibrated joint multiplier (adaptive clipping; its
    count's noise follows the sum's, :func:`~fl_examples.core.dp_modes.adaptive_count_stddev`,
    so every target is reachable)."""
    assert plan.adaptive is not None
    return adaptive_sum_noise(plan.expected_clients, joint)


def _privacy_plan(algorithm: str, cfg: UpcycledConfig, ds: FederatedDataset, iterations: int
                  ) -> tuple[Any, dict[str, Any]]:
    if cfg.privacy == "none":
        return None, {}
    if cfg.privacy in ("client", "record"):
        return _dp_plan(algorithm, cfg, ds, iterations)
    if cfg.privacy == "objective" and algorithm == "fedavg":
        raise InvalidParameterError("algorithms", "fedavg",
                                    "not combined with objective perturbation (it needs mu > 0)")
    if cfg.noise_for_epsilon is None:
        return _plan_for(cfg, ds, algorithm), {}
    name = "sigma" if cfg.privacy == "output" else "alpha"
    with status(f"calibrating {algorithm}'s {name} to epsilon {cfg.noise_for_epsilon:g} "
                f"(delta {cfg.delta:g}, {data_rounds(algorithm, iterations)} data rounds, "
                f"{cfg.noise_target} over clients)") as line:
        counts = planned_releases(algorithm, cfg, ds, iterations)
        x, eps = calibrate(lambda v: _plan_for(cfg, ds, algorithm, v), counts,
                           target=cfg.noise_for_epsilon, delta=cfg.delta,
                           statistic=cfg.noise_target,
                           larger_is_more_private=cfg.privacy == "output")
        line.done(f"{name} = {x:.4g} (planned epsilon {eps:.4g})")
    info = {"calibrated": {"parameter": "stddev" if cfg.privacy == "output" else "alpha",
                           "value": x, "target_epsilon": cfg.noise_for_epsilon,
                           "statistic": cfg.noise_target, "planned_epsilon": eps}}
    return _plan_for(cfg, ds, algorithm, x), info
