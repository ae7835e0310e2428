"""Distributed DP (secure aggregation, each client's own Skellam share) against central
DP-FedAvg at the same epsilon **under the same threat model**.

Central DP-FedAvg's headline epsilon uses Poisson amplification, which distributed DP cannot
match (a client that leaves the cohort takes its noise share with it; only joint convexity
applies, and only against outsiders). So the two are compared where both guarantees mean the
same thing:

- ``every-round`` (the first table): **every client in every round** (q = 1) on
  ``digits:iid@200`` (60 data rounds, clip 1): no amplification in either mode, so both
  epsilons hold against the server and against everyone; the trainers' own
  ``--noise-for-epsilon`` (central: a fixed clip), FedAvg and Upcycled-FL (the same data
  rounds; Upcycled-FL's even iterations are free), epsilon 2, 4, 8 at delta 1e-5, distributed
  at 16 and 20 bits.
- ``server``: **both priced against the server**, which picks the cohort, on
  ``synthetic:iid@2000/500`` at the client-level bench's Poisson rate q = 0.05 (100 data
  rounds, clip 3): the unamplified composition of every round (the epsilon of a client
  sampled in all T rounds). Central: z calibrated so that T unamplified Gaussian releases have
  the target epsilon (``--noise-multiplier``, a fixed clip); distributed: the released sum's
  noise multiplier bisected so that T unamplified Skellam releases with ``min_survivors``
  shares (the default: at most 1% of rounds skipped, 78 of an expected 100) have it; each
  released round's shares are scaled to its cohort (the trainers' default
  ``--dropout-tolerance 0``: the sum carries the priced noise, not 100/78 of it). Each row
  gives the epsilon the run itself reports against the server
  (``epsilon_unamplified.epsilon_every_round``), at most the target.
- ``control`` (not in the default run): where the gap comes from. FedAvg in both settings
  above, with a third contender beside central DP and distributed DP at each ``--bits``:
  central DP run at the noise multiplier the distributed mode's sums carried (larger than
  central DP's at the same epsilon by what the Skellam's pricing and the rounding's norm
  inflation cost: 6-8% under its RDP bound, 0.1-0.4% under its Gaussian-DP). If distributed
  DP loses what that run loses, the gap is the accounting's, not the encoding's. Use many
  ``--seeds`` (20): one run's held-out accuracy moves by 1.5 points from seed to seed;
  ``--first-seed`` runs a fresh set.
- ``twin`` (not in the default run): the encoding's cost with the noise draws held equal,
  against the server (the setting above), for ``--algorithms``: the **Gaussian twin** of a
  distributed run (its skip rule, clip, rotation, scaling and conditional rounding with each
  client's own coins, but no noise shares: the integer sum gets central DP's own Gaussian
  draw at the run's z, rotated and rounded onto the lattice) paired by seed with central DP
  at that z. The twin differs from central DP only by the encoding (and the noise's
  rounding), and from distributed DP only by the noise's law (``round(N(0, V))`` for a sum of
  Skellam shares of variance V), a total variation the row's note bounds. A diagnostic (the
  twin needs a trusted aggregator), never a trainer mode.
- ``bits``: accuracy against the modulus (8 to 20 bits) at epsilon 4, FedAvg, in both
  settings above, with the decoded mean's MSE against central DP's at the expected cohort;
  too few bits is refused by the calibration (the sum of the rounding errors alone nears
  2^(bits-1)) and shown as such.
- ``cost``: the client-side encode (clip, rotate, round, noise, wrap) per client and round
  against one client's local training in the same round (trained alone, K = 1), median over
  clients; wall-clock on this machine (shared: noisy).
- ``flower``: distributed DP on Flower's own SecAgg+ (``privkit.flower.DistributedDP`` and
  ``DistributedDpMod`` in ``run_simulation``, Ray) with ``--supernodes`` SuperNodes (20 by
  default) holding ``digits:iid@<n>``, every node every round, FedAvg with the trainers'
  local solver, against the trainer's central mode on the same data and settings at the same
  epsilon (seeds), and the trainer's distributed mode.

Writes ``OUT/distributed.csv`` and prints the tables.

    python bench/distributed.py --out runs/distributed            # the docs' tables
    python bench/distributed.py --quick                           # a smaller run
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import privkit  # noqa: E402
from fl_examples.core.data import parse_dataset_spec  # noqa: E402
from fl_examples.core.distributed import (  # noqa: E402
    NOISE_STREAM,
    DistributedDpPlan,
    distributed_plan,
    rotation_seed,
)
from fl_examples.core.dp_modes import server_step  # noqa: E402
from fl_examples.core.models import num_parameters  # noqa: E402
from fl_examples.core.seeds import SeedTree  # noqa: E402
from fl_examples.upcycled import UpcycledConfig, run_algorithm  # noqa: E402
from fl_examples.upcycled.config import _model  # noqa: E402
from privkit.errors import InvalidParameterError  # noqa: E402
from privkit.mechanisms.aggregate import unamplified_event  # noqa: E402
from privkit.mechanisms.distributed import (  # noqa: E402
    hadamard_rotate,
    inverse_hadamard_rotate,
)
from privkit.mechanisms.sampling import gaussian_noise  # noqa: E402

DELTA = 1e-5
SECTIONS = ["server", "every-round", "control", "twin", "bits", "cost", "flower"]
#: Sections the default run leaves out (diagnostics; many seeds).
DIAGNOSTICS = ("control", "twin")
FIELDS = ["section", "dataset", "algorithm", "mode", "bits", "target_epsilon",
          "epsilon_server", "epsilon_headline", "heldout_accuracy", "accuracy_se", "seeds",
          "per_seed", "gap_to_central", "gap_se", "seconds", "note"]
#: (spec, data rounds, q, clip, local epochs, batch, lr): the client-level bench settings.
SETUPS = [("synthetic:iid@2000/500", 100, 0.05, 3.0, 5, 32, 0.05),
          ("digits:iid@200", 60, 0.1, 1.0, 5, 16, 0.1)]


def _row(**kw: Any) -> dict[str, Any]:
    out = {k: "" for k in FIELDS}
    out.update(kw)
    return out


def _base(spec: str, q: float, clip: float, epochs: int, batch: int, lr: float
          ) -> dict[str, Any]:
    return dict(dataset=spec, mu=0.01, lam=0.04, local_epochs=epochs, batch_size=batch, lr=lr,
                momentum=0.5, stragglers=0.0, fraction=q, device="cpu", eval_every=10**6,
                privacy="client", client_rate=q, l2_clip_norm=clip, delta=DELTA)


def central_z(target: float, rounds: int) -> float:
    """z whose T unamplified Gaussian releases have epsilon ``target`` (against the server)."""
    z, _, _ = privkit.calibrate_noise(lambda x: unamplified_event(x, rounds),
                                      target_epsilon=target, delta=DELTA, tol=1e-5)
    while privkit.epsilon(unamplified_event(z, rounds), DELTA).epsilon > target:
        z *= 1 + 1e-5
    return float(z)


def distributed_z(target: float, rounds: int, *, n: int, q: float, clip: float, dim: int,
                  bits: int) -> float:
    """The distributed plan's noise multiplier whose T unamplified releases have epsilon
    ``target`` (bisection on log z: the plan the trainer builds from it, priced exactly)."""
    def eps(z: float) -> float:
        plan, _ = distributed_plan(num_clients=n, client_rate=q, l2_clip_norm=clip, dim=dim,
                                   bits=bits, rounds=rounds, delta=DELTA, noise_multiplier=z)
        return privkit.epsilon(plan.mechanism().unamplified_event(rounds), DELTA,
                               neighboring_relation="zero-out").epsilon

    lo, hi = 0.1, 1.0
    while eps(hi) > target:
        lo, hi = hi, hi * 2
    while eps(lo) <= target:
        lo /= 2
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= target else (mid, hi)
    return hi


# ------------------------------------------------------------- the Gaussian twin
@torch.no_grad()
def _twin_release(self: DistributedDpPlan, w: dict[str, torch.Tensor],
                  local: dict[str, torch.Tensor], state: dict[str, Any], generator: Any = None,
                  *, sel: Any, data_round: int, tree: SeedTree, secure: Any = None,
                  canaries: Any = None) -> dict[str, torch.Tensor]:
    """:meth:`DistributedDpPlan.release` with every step of the clients' encoding (the skip
    rule, clip, the round's rotation, scaling, conditional rounding with each client's own
    coins) but **no noise shares**: the integer sum gets ``round(N(0, V))`` per rotated
    coordinate instead, V = (z C / gamma)^2 = n_min mu the variance the shares' sum carries.
    The Gaussian is central DP's own draw at the plan's z (``generator``, on the float64
    sum, as :class:`~privkit.mechanisms.ClientLevelGaussian` draws it) padded with
    ``padded_dim - dim`` more from a stream of its own, rotated (isotropic: the rotated
    coordinates are i.i.d. N(0, V gamma^2)), and rounded to the lattice, so the twin is paired
    draw for draw with central DP at z (it differs by the encoding and the noise's rounding,
    at most gamma / 2 per rotated coordinate), and its law differs from distributed DP's only
    by ``Skellam(V)`` against ``round(N(0, V))`` on each rotated coordinate and the wrap
    (:func:`twin_distance`). A diagnostic of the bench (it needs a trusted aggregator), never
    a mode of the trainers."""
    assert secure is None and canaries is None, "the twin is a seeded diagnostic"
    counts = state.setdefault("distributed", {"released": 0, "skipped": 0, "wrapped": 0})
    if self.skips(sel):
        counts["skipped"] += 1
        return {k: v.clone() for k, v in w.items()}
    seed = rotation_seed(tree, data_round)
    names = list(w)
    total = np.zeros(self.padded_dim, dtype=np.int64)
    for j, c in enumerate(np.asarray(sel).tolist()):
        update = np.concatenate([(local[k][j] - w[k]).detach().to(torch.float64).cpu()
                                 .numpy().reshape(-1) for k in names])
        # the clients' encoder without the share (an audit canary's), the client's own coins
        _, ints = self.canary_input(update, rotation_seed=seed,
                                    rng=tree.numpy(data_round, f"{NOISE_STREAM}/{int(c)}"))
        total += ints
    counts["released"] += 1
    shares = state.setdefault("distributed_shares",
                              {"shares": 0, "variance": 0.0, "released_z": 0.0})
    shares["shares"] += len(sel)
    shares["variance"] += len(sel) * self.noise_share(len(sel))
    shares["released_z"] += self.noise_multiplier
    flat_w = torch.cat([v.reshape(-1) for v in w.values()])
    sd = self.noise_multiplier * float(self.l2_clip_norm)
    g = gaussian_noise({"update": torch.zeros(flat_w.shape, dtype=torch.float64)}, sd,
                       rng=generator)["update"].cpu().numpy()
    pad = tree.numpy(data_round, "twin-padding").standard_normal(self.padded_dim - g.size) * sd
    gamma = float(self.granularity)
    total += np.rint(hadamard_rotate(np.concatenate([g, pad]), seed) / gamma).astype(np.int64)
    decoded = inverse_hadamard_rotate(total.astype(np.float64) * gamma, seed)[: int(self.dim)]
    flat = torch.as_tensor(decoded).to(flat_w.dtype) / self.expected_clients
    mean, start = {}, 0
    for k in names:
        size = w[k].numel()
        mean[k] = flat[start:start + size].reshape(w[k].shape)
        start += size
    return server_step(w, mean, state, lr=self.server_lr, momentum=self.server_momentum)


def skellam_rounded_gaussian_tv(variance: float) -> float:
    """The total variation distance between ``Skellam(V)`` (variance V, symmetric) and
    ``round(N(0, V))``, summed over every integer within 60 standard deviations (the rest of
    both laws is below 1e-300) from privkit's Skellam masses."""
    from scipy.special import ndtr

    from privkit.accountants._skellam_gdp import _log_pmf

    sd = math.sqrt(variance)
    k = np.arange(0, int(60 * sd) + 2, dtype=np.float64)
    sk = np.exp(_log_pmf(k, float(variance)))
    # P(round(N) = k) for k >= 0 from the upper tail (no cancellation in the tails)
    gauss = ndtr(-(k - 0.5) / sd) - ndtr(-(k + 0.5) / sd)
    gauss[0] = 1.0 - 2.0 * ndtr(-0.5 / sd)
    diff = np.abs(sk - gauss)
    return float(0.5 * (diff[0] + 2.0 * diff[1:].sum()))


def twin_distance(plan: DistributedDpPlan, rounds: int) -> float:
    """A bound on the total variation between a whole run of distributed DP and of its
    Gaussian twin (the same data, cohorts, coins and rounding): ``rounds x padded_dim`` times
    the distance of one rotated coordinate's noise, ``Skellam(n mu_n)`` against
    ``round(N(0, n_min mu))`` (the shares' sum over a cohort of n, within a relative 1e-15 of
    n_min mu), plus ``rounds`` times the calibrated wrap-around bound. The expected held-out
    accuracies of the two then differ by at most this (accuracy lies in [0, 1])."""
    v = float(plan.min_survivors) * float(plan.noise_per_client)
    return rounds * (plan.padded_dim * skellam_rounded_gaussian_tv(v) + plan.wrap_bound)


@contextlib.contextmanager
def gaussian_twin() -> Any:
    """Runs inside use :func:`_twin_release` for distributed DP's rounds."""
    with mock.patch.object(DistributedDpPlan, "release", _twin_release):
        yield


#: The first seed of every cell (``--first-seed``): cells run seeds FIRST_SEED, FIRST_SEED + 1, ...
FIRST_SEED = 0


def _run(alg: str, cfg: UpcycledConfig, ds: Any, rounds: int, seeds: int
         ) -> tuple[list[float], dict[str, Any], float]:
    """Held-out accuracy per seed, the last run's privacy section and the seconds."""
    it = 2 * rounds - 1 if alg == "upcycled" else rounds
    accs, p = [], {}
    t0 = time.perf_counter()
    for seed in range(FIRST_SEED, FIRST_SEED + seeds):
        c = UpcycledConfig(**(cfg.__dict__ | {"seed": seed, "iterations": it}))
        r = run_algorithm(alg, c, ds, iterations=it)
        accs.append(float(r["history"][-1]["heldout_accuracy"]))
        p = r["privacy"]
    return accs, p, time.perf_counter() - t0


def _se(xs: list[float]) -> float:
    return float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else float("nan")


def _pairs(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [x - y for x, y in zip(a, b)]
    return float(np.mean(d)), _se(d)


def _show(r: dict[str, Any]) -> None:
    eps = "" if r["epsilon_server"] == "" else f"eps vs server {r['epsilon_server']:.3f}"
    gap = "" if r["gap_to_central"] == "" else (
        f"  gap {100 * r['gap_to_central']:+.1f}"
        + (f"+-{100 * r['gap_se']:.1f}" if math.isfinite(r["gap_se"]) else "") + " pts")
    acc = "" if r["heldout_accuracy"] == "" else f"acc {r['heldout_accuracy']:.4f}"
    secs = "" if r["seconds"] == "" else f"  {r['seconds']:.0f} s"
    note = f"  [{r['note']}]" if r["note"] else ""
    print(f"  {r['section']:<11} {r['dataset']:<22} {r['algorithm']:<9} {r['mode']:<16} "
          f"{eps:<22} {acc}{gap}{secs}{note}", flush=True)


# ----------------------------------------------------------------------------- sections
def server_section(quick: bool, epsilons: tuple[float, ...], seeds: int,
                   bits_list: tuple[int, ...] = (16, 20),
                   algorithms: tuple[str, ...] = ("fedavg", "upcycled")
                   ) -> list[dict[str, Any]]:
    """Both modes priced against the server (module docstring)."""
    rows = []
    for spec, rounds, q, clip, epochs, batch, lr in SETUPS[:1]:
        rounds = 30 if quick else rounds
        ds = parse_dataset_spec(spec, seed=0)
        base = _base(spec, q, clip, epochs, batch, lr)
        dim = num_parameters(_model(UpcycledConfig(**base), ds))
        for alg in algorithms:
            for e in epsilons:
                z = central_z(e, rounds)
                cfg = UpcycledConfig(**base, noise_multiplier=z, adaptive_clip=0.0)
                ref, p, secs = _run(alg, cfg, ds, rounds, seeds)
                rows.append(_row(section="server", dataset=spec, algorithm=alg,
                                 mode="central", target_epsilon=e,
                                 epsilon_server=p["epsilon_unamplified"]["epsilon_every_round"],
                                 epsilon_headline=p["epsilon_max"],
                                 heldout_accuracy=float(np.mean(ref)), accuracy_se=_se(ref),
                                 seeds=seeds, per_seed=" ".join(f"{a:.4f}" for a in ref),
                                 seconds=secs, note=f"z {z:.3g}, {rounds} rounds, q {q:g}"))
                _show(rows[-1])
                for bits in bits_list:
                    zd = distributed_z(e, rounds, n=ds.num_clients, q=q, clip=clip, dim=dim,
                                       bits=bits)
                    cfg = UpcycledConfig(**base, aggregation="distributed", bits=bits,
                                         noise_multiplier=zd)
                    accs, p, secs = _run(alg, cfg, ds, rounds, seeds)
                    gap, gap_se = _pairs(accs, ref)
                    rows.append(_row(
                        section="server", dataset=spec, algorithm=alg,
                        mode=f"distributed {bits}b", bits=bits, target_epsilon=e,
                        epsilon_server=p["epsilon_unamplified"]["epsilon_every_round"],
                        epsilon_headline=p["epsilon_max"],
                        heldout_accuracy=float(np.mean(accs)), accuracy_se=_se(accs),
                        seeds=seeds, per_seed=" ".join(f"{a:.4f}" for a in accs),
                        gap_to_central=gap, gap_se=gap_se, seconds=secs,
                        note=f"z {zd:.3g} at n_min {p['min_survivors']}, mean released z "
                             f"{p['mean_released_noise_multiplier']:.3g} (f "
                             f"{p['dropout_tolerance']:g}), {p['skipped_rounds']} skipped"))
                    _show(rows[-1])
    return rows


def every_round_section(quick: bool, epsilons: tuple[float, ...], seeds: int,
                        bits_list: tuple[int, ...] = (16, 20),
                        algorithms: tuple[str, ...] = ("fedavg", "upcycled")
                        ) -> list[dict[str, Any]]:
    """Every client in every round, the trainers' own calibration (module docstring)."""
    spec, rounds, _, clip, epochs, batch, lr = SETUPS[1]
    rounds = 20 if quick else rounds
    ds = parse_dataset_spec(spec, seed=0)
    base = _base(spec, 1.0, clip, epochs, batch, lr)
    rows = []
    for alg, e in ((a, e) for a in algorithms for e in epsilons):
        ref, p, secs = _run(alg, UpcycledConfig(**base, noise_for_epsilon=e,
                                                adaptive_clip=0.0), ds, rounds, seeds)
        rows.append(_row(section="every-round", dataset=spec, algorithm=alg,
                         mode="central", target_epsilon=e, epsilon_server=p["epsilon_max"],
                         epsilon_headline=p["epsilon_max"],
                         heldout_accuracy=float(np.mean(ref)), accuracy_se=_se(ref),
                         seeds=seeds, per_seed=" ".join(f"{a:.4f}" for a in ref),
                         seconds=secs, note=f"z {p['noise_multiplier']:.3g}, q 1"))
        _show(rows[-1])
        for bits in bits_list:
            cfg = UpcycledConfig(**base, noise_for_epsilon=e, aggregation="distributed",
                                 bits=bits)
            accs, p, secs = _run(alg, cfg, ds, rounds, seeds)
            gap, gap_se = _pairs(accs, ref)
            rows.append(_row(section="every-round", dataset=spec, algorithm=alg,
                             mode=f"distributed {bits}b", bits=bits, target_epsilon=e,
                             epsilon_server=p["epsilon_max"], epsilon_headline=p["epsilon_max"],
                             heldout_accuracy=float(np.mean(accs)), accuracy_se=_se(accs),
                             seeds=seeds, per_seed=" ".join(f"{a:.4f}" for a in accs),
                             gap_to_central=gap, gap_se=gap_se, seconds=secs,
                             note=f"z {p['noise_multiplier']:.3g} (MSE "
                                  f"{p['calibrated']['mse_ratio_to_central']:.3f}x central)"
                             if "calibrated" in p else ""))
            _show(rows[-1])
    return rows


def _accuracies(accs: list[float], seeds: int, ref: list[float] | None = None
                ) -> dict[str, Any]:
    """A row's accuracy fields: the mean, its standard error, the seeds and each seed's, and
    with ``ref`` the gap to it paired by seed."""
    out: dict[str, Any] = dict(heldout_accuracy=float(np.mean(accs)), accuracy_se=_se(accs),
                               seeds=seeds, per_seed=" ".join(f"{a:.4f}" for a in accs))
    if ref is not None:
        out["gap_to_central"], out["gap_se"] = _pairs(accs, ref)
    return out


def control_section(quick: bool, epsilons: tuple[float, ...], seeds: int,
                    bits_list: tuple[int, ...]) -> list[dict[str, Any]]:
    """FedAvg in both settings (every client in every round on digits; both priced against
    the server on the synthetic task): central DP, distributed DP at each modulus, and
    central DP at the noise multiplier the distributed mode's sums carried (module
    docstring)."""
    rows = []

    def add(spec: str, mode: str, e: float, accs: list[float], eps_server: float,
            eps_headline: float, secs: float, note: str, ref: list[float] | None,
            **kw: Any) -> None:
        rows.append(_row(section="control", dataset=spec, algorithm="fedavg", mode=mode,
                         target_epsilon=e, epsilon_server=eps_server,
                         epsilon_headline=eps_headline, seconds=secs, note=note,
                         **_accuracies(accs, seeds, ref), **kw))
        _show(rows[-1])

    # every client in every round: the trainers' own calibration, no amplification
    spec, rounds, _, clip, epochs, batch, lr = SETUPS[1]
    rounds = 20 if quick else rounds
    ds = parse_dataset_spec(spec, seed=0)
    base = _base(spec, 1.0, clip, epochs, batch, lr)
    for e in epsilons:
        ref, p, secs = _run("fedavg", UpcycledConfig(**base, noise_for_epsilon=e,
                                                     adaptive_clip=0.0), ds, rounds, seeds)
        z_central = float(p["noise_multiplier"])
        add(spec, "central", e, ref, p["epsilon_max"], p["epsilon_max"], secs,
            f"z {z_central:.4g}", None)
        z_dist = None
        for bits in bits_list:
            cfg = UpcycledConfig(**base, noise_for_epsilon=e, aggregation="distributed",
                                 bits=bits)
            accs, p, secs = _run("fedavg", cfg, ds, rounds, seeds)
            z_dist = z_dist or float(p["noise_multiplier"])
            add(spec, f"distributed {bits}b", e, accs, p["epsilon_max"], p["epsilon_max"],
                secs, f"z {float(p['noise_multiplier']):.4g}", ref, bits=bits)
        assert z_dist is not None
        accs, p, secs = _run("fedavg", UpcycledConfig(**base, noise_multiplier=z_dist,
                                                      adaptive_clip=0.0), ds, rounds, seeds)
        add(spec, "central at the distributed z", e, accs, p["epsilon_max"], p["epsilon_max"],
            secs, f"z {z_dist:.4g} = {z_dist / z_central:.3f} x central's", ref)
    # both priced against the server (Poisson cohorts, the unamplified composition)
    spec, rounds, q, clip, epochs, batch, lr = SETUPS[0]
    rounds = 30 if quick else rounds
    ds = parse_dataset_spec(spec, seed=0)
    base = _base(spec, q, clip, epochs, batch, lr)
    dim = num_parameters(_model(UpcycledConfig(**base), ds))
    for e in epsilons:
        z_central = central_z(e, rounds)
        ref, p, secs = _run("fedavg", UpcycledConfig(**base, noise_multiplier=z_central,
                                                     adaptive_clip=0.0), ds, rounds, seeds)
        add(spec, "central", e, ref, p["epsilon_unamplified"]["epsilon_every_round"],
            p["epsilon_max"], secs, f"z {z_central:.4g}", None)
        z_dist = None
        for bits in bits_list:
            zd = distributed_z(e, rounds, n=ds.num_clients, q=q, clip=clip, dim=dim, bits=bits)
            cfg = UpcycledConfig(**base, aggregation="distributed", bits=bits,
                                 noise_multiplier=zd)
            accs, p, secs = _run("fedavg", cfg, ds, rounds, seeds)
            released = float(p["mean_released_noise_multiplier"])
            z_dist = z_dist or released
            add(spec, f"distributed {bits}b", e, accs,
                p["epsilon_unamplified"]["epsilon_every_round"], p["epsilon_max"], secs,
                f"mean released z {released:.4g}", ref, bits=bits)
        assert z_dist is not None
        accs, p, secs = _run("fedavg", UpcycledConfig(**base, noise_multiplier=z_dist,
                                                      adaptive_clip=0.0), ds, rounds, seeds)
        add(spec, "central at the distributed z", e, accs,
            p["epsilon_unamplified"]["epsilon_every_round"], p["epsilon_max"], secs,
            f"z {z_dist:.4g} = {z_dist / z_central:.3f} x central's", ref)
    return rows


def twin_section(quick: bool, epsilons: tuple[float, ...], seeds: int,
                 bits_list: tuple[int, ...], algorithms: tuple[str, ...]
                 ) -> list[dict[str, Any]]:
    """The encoding's cost with the noise draws held equal, against the server (module
    docstring): central DP at the noise multiplier a distributed run's sums carry, and the
    Gaussian twin of that run (:func:`_twin_release`), paired by seed."""
    rows = []
    spec, rounds, q, clip, epochs, batch, lr = SETUPS[0]
    rounds = 30 if quick else rounds
    ds = parse_dataset_spec(spec, seed=0)
    base = _base(spec, q, clip, epochs, batch, lr)
    dim = num_parameters(_model(UpcycledConfig(**base), ds))
    for alg, e, bits in ((a, e, b) for a in algorithms for e in epsilons for b in bits_list):
        zd = distributed_z(e, rounds, n=ds.num_clients, q=q, clip=clip, dim=dim, bits=bits)
        cfg = UpcycledConfig(**base, aggregation="distributed", bits=bits, noise_multiplier=zd)
        plan, _ = distributed_plan(num_clients=ds.num_clients, client_rate=q, l2_clip_norm=clip,
                                   dim=dim, bits=bits, rounds=rounds, delta=DELTA,
                                   noise_multiplier=zd)
        tv = twin_distance(plan, rounds)
        with gaussian_twin():
            twin, p, secs_twin = _run(alg, cfg, ds, rounds, seeds)
        z = float(p["mean_released_noise_multiplier"])
        ref, pc, secs = _run(alg, UpcycledConfig(**base, noise_multiplier=z, adaptive_clip=0.0),
                             ds, rounds, seeds)
        rows.append(_row(section="twin", dataset=spec, algorithm=alg,
                         mode=f"central at z({bits}b)", bits=bits, target_epsilon=e,
                         epsilon_server=pc["epsilon_unamplified"]["epsilon_every_round"],
                         epsilon_headline=pc["epsilon_max"], seconds=secs, note=f"z {z:.4g}",
                         **_accuracies(ref, seeds)))
        _show(rows[-1])
        rows.append(_row(section="twin", dataset=spec, algorithm=alg,
                         mode=f"twin {bits}b", bits=bits, target_epsilon=e,
                         seconds=secs_twin, **_accuracies(twin, seeds, ref),
                         note=f"the encoding with central's Gaussian (a trusted "
                              f"aggregator); total variation to distributed DP <= {tv:.1e}"))
        _show(rows[-1])
    return rows


def bits_section(quick: bool, seeds: int, epsilon: float = 4.0) -> list[dict[str, Any]]:
    """Accuracy against bits at epsilon 4, FedAvg: synthetic under the server threat model
    (q = 0.05), digits with every client in every round (q = 1). ``mse`` is the decoded mean's
    error (noise and rounding) at the expected cohort over central DP's at the same epsilon."""
    rows = []
    for (spec, rounds, q, clip, epochs, batch, lr), every in ((SETUPS[0], False),
                                                              (SETUPS[1], True)):
        rounds = (20 if every else 30) if quick else rounds
        q = 1.0 if every else q
        ds = parse_dataset_spec(spec, seed=0)
        base = _base(spec, q, clip, epochs, batch, lr)
        dim = num_parameters(_model(UpcycledConfig(**base), ds))
        zc = central_z(epsilon, rounds)  # q = 1: the same as the trainer's calibration
        m = q * ds.num_clients
        for bits in ((10, 16) if quick else (8, 10, 12, 14, 16, 20)):
            try:
                zd = distributed_z(epsilon, rounds, n=ds.num_clients, q=q, clip=clip,
                                   dim=dim, bits=bits)
            except InvalidParameterError as exc:
                rows.append(_row(section="bits", dataset=spec, algorithm="fedavg",
                                 mode=f"distributed {bits}b", bits=bits,
                                 target_epsilon=epsilon,
                                 note=f"refused: {str(exc).split(': ', 1)[-1]}"[:110]))
                _show(rows[-1])
                continue
            cfg = UpcycledConfig(**base, aggregation="distributed", bits=bits,
                                 noise_multiplier=zd)
            accs, p, secs = _run("fedavg", cfg, ds, rounds, seeds)
            g2 = p["granularity"] ** 2
            mse = g2 * (m * p["noise_per_client"] + m / 4) / (zc * clip) ** 2
            rows.append(_row(section="bits", dataset=spec, algorithm="fedavg",
                             mode=f"distributed {bits}b", bits=bits, target_epsilon=epsilon,
                             epsilon_server=p["epsilon_unamplified"]["epsilon_every_round"],
                             epsilon_headline=p["epsilon_max"],
                             heldout_accuracy=float(np.mean(accs)), accuracy_se=_se(accs),
                             seeds=seeds, per_seed=" ".join(f"{a:.4f}" for a in accs),
                             seconds=secs,
                             note=f"q {q:g}, gamma {p['granularity']:.3g}, MSE {mse:.3f}x "
                                  f"central at {m:g} clients, {p['wrapped_rounds']} wrapped"))
            _show(rows[-1])
    return rows


def cost_section(quick: bool) -> list[dict[str, Any]]:
    """Client-side encode time against one client's local training, per round."""
    from fl_examples.core.data import Split
    from fl_examples.core.local import local_sgd
    from fl_examples.core.rounds import broadcast, select, to_client_data

    rows = []
    for spec, rounds, q, clip, epochs, batch, lr in SETUPS:
        ds = parse_dataset_spec(spec, seed=0)
        base = _base(spec, q, clip, epochs, batch, lr)
        model = _model(UpcycledConfig(**base), ds)
        dim = num_parameters(model)
        init = model.init(1, generator=torch.Generator().manual_seed(0), device="cpu")
        w = {k: v[0] for k, v in init.items()}
        data = to_client_data(ds.padded(Split.TRAIN), torch.device("cpu"), torch.float32)
        clients = list(range(10 if quick else 40))
        train_s, enc_s = [], {}
        for c in clients:
            one = select(data, torch.tensor([c]))
            t0 = time.perf_counter()
            local = local_sgd(model, broadcast(w, 1), w, one, epochs=epochs, batch_size=batch,
                              lr=lr, momentum=0.5, generator=torch.Generator().manual_seed(c))
            train_s.append(time.perf_counter() - t0)
            u = np.concatenate([(local[k][0] - w[k]).double().numpy().reshape(-1) for k in w])
            for bits in (16, 20):
                plan, _ = distributed_plan(num_clients=ds.num_clients, client_rate=q,
                                           l2_clip_norm=clip, dim=dim, bits=bits, rounds=rounds,
                                           delta=DELTA, noise_multiplier=10.0)
                mech = plan.mechanism()
                tree = SeedTree(0)
                t0 = time.perf_counter()
                mech.encode(u, rng=tree.numpy(1, f"distributed-noise/{c}"),
                            rotation_seed=rotation_seed(tree, 1))
                enc_s.setdefault(bits, []).append(time.perf_counter() - t0)
        tr = statistics.median(train_s)
        for bits, xs in enc_s.items():
            en = statistics.median(xs)
            rows.append(_row(section="cost", dataset=spec, algorithm="client",
                             mode=f"encode {bits}b", bits=bits, seconds=en,
                             note=f"encode {1e3 * en:.2f} ms vs local training {1e3 * tr:.1f} ms "
                                  f"({epochs} epochs, batch {batch}): {100 * en / tr:.1f}%; "
                                  f"{dim} parameters, {plan.padded_dim} rotated; load "
                                  f"{os.getloadavg()[0]:.1f}"))
            print(f"  cost        {spec:<22} {rows[-1]['note']}", flush=True)
    return rows


# ----------------------------------------------------------------------------- Flower
def flower_section(quick: bool, supernodes: int, rounds: int, epsilon: float, seeds: int
                   ) -> list[dict[str, Any]]:
    """SecAgg+ in Flower's simulation engine against the trainer (module docstring)."""
    import logging

    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow
    from flwr.simulation import run_simulation

    from fl_examples.core.data import Split
    from fl_examples.core.rounds import evaluate, select, to_client_data
    from fl_examples.flower.client import local_update
    from privkit.flower import DistributedDP, DistributedDpMod, secaggplus_workflow
    from privkit.flower import records as keys
    from privkit.mechanisms import DistributedSkellam

    spec = f"digits:iid@{supernodes}"
    clip, epochs, batch, lr, bits = 1.0, 5, 16, 0.1, 16
    ds = parse_dataset_spec(spec, seed=0)
    base = _base(spec, 1.0, clip, epochs, batch, lr)
    rows = []
    ref, p, secs = _run("fedavg", UpcycledConfig(**base, noise_for_epsilon=epsilon,
                                                 adaptive_clip=0.0), ds, rounds, seeds)
    rows.append(_row(section="flower", dataset=spec, algorithm="fedavg",
                     mode="central (trainer)", target_epsilon=epsilon,
                     epsilon_server=p["epsilon_max"], epsilon_headline=p["epsilon_max"],
                     heldout_accuracy=float(np.mean(ref)), accuracy_se=_se(ref), seeds=seeds,
                     per_seed=" ".join(f"{a:.4f}" for a in ref), seconds=secs,
                     note=f"{rounds} rounds, every client every round"))
    _show(rows[-1])
    cfg = UpcycledConfig(**base, noise_for_epsilon=epsilon, aggregation="distributed",
                         bits=bits)
    sim, p, secs = _run("fedavg", cfg, ds, rounds, seeds)
    rows.append(_row(section="flower", dataset=spec, algorithm="fedavg",
                     mode=f"distributed {bits}b (trainer)", bits=bits,
                     target_epsilon=epsilon, epsilon_server=p["epsilon_max"],
                     epsilon_headline=p["epsilon_max"], heldout_accuracy=float(np.mean(sim)),
                     accuracy_se=_se(sim), seeds=seeds,
                     per_seed=" ".join(f"{a:.4f}" for a in sim), seconds=secs,
                     gap_to_central=_pairs(sim, ref)[0], gap_se=_pairs(sim, ref)[1]))
    _show(rows[-1])
    # the same mechanism the trainer calibrated, on Flower's SecAgg+
    plan_kw = p["calibrated"]
    model = _model(UpcycledConfig(**base), ds)
    dim = num_parameters(model)
    mech = DistributedSkellam(l2_clip_norm=clip, granularity=plan_kw["granularity"],
                              noise_per_client=plan_kw["noise_per_client"], bits=bits, dim=dim,
                              min_survivors=supernodes)
    heldout = to_client_data(ds.heldout_padded(), torch.device("cpu"), torch.float32)
    train = to_client_data(ds.padded(Split.TRAIN), torch.device("cpu"), torch.float32)
    names = list(model.parameter_shapes())
    shapes = model.parameter_shapes()

    def unflat(arrays: list[np.ndarray]) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(a, dtype=torch.float32).reshape(shapes[k])
                for k, a in zip(names, arrays)}

    class Client(NumPyClient):
        def __init__(self, cid: int) -> None:
            self.cid = cid

        def fit(self, parameters: Any, config: Any) -> Any:
            w = unflat(parameters)
            one = select(train, torch.tensor([self.cid]))
            new = local_update(model, w, one, dict(config), client=self.cid)
            return [new[k].numpy() for k in names], int(one.sizes[0]), {}

    def client_fn(context: Any) -> Any:
        return Client(int(context.node_config["partition-id"])).to_client()

    client = ClientApp(client_fn=client_fn, mods=[secaggplus_mod, DistributedDpMod()])
    accs, flower_secs = [], []
    for seed in range(FIRST_SEED, FIRST_SEED + seeds):
        out: dict[str, Any] = {}
        init = model.init(1, generator=SeedTree(seed).torch(0, "init", "cpu"), device="cpu")
        w0 = [init[k][0].numpy() for k in names]
        server = ServerApp()

        def fit_config(r: int, seed: int = seed) -> dict[str, Any]:
            return {keys.SEED: seed, keys.DATA_ROUND: r, keys.LOCAL_EPOCHS: epochs,
                    keys.LR: lr, keys.BATCH_SIZE: batch, keys.MOMENTUM: 0.0,
                    keys.BATCH_ORDER: "per-client"}

        def record(r: int, params: Any, config: Any, seed: int = seed) -> Any:
            _, acc = evaluate(model, unflat(params), heldout)
            out.setdefault("acc", {})[r] = acc
            return None

        @server.main()
        def main(grid: Any, context: Any, seed: int = seed) -> None:
            inner = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0,
                           min_available_clients=supernodes,
                           initial_parameters=ndarrays_to_parameters(w0),
                           on_fit_config_fn=fit_config, evaluate_fn=record)
            dp = DistributedDP(inner, num_clients=supernodes, client_rate=1.0, mechanism=mech,
                               seed=None, node_timeout=120)
            ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=rounds),
                                strategy=dp)
            DefaultWorkflow(fit_workflow=secaggplus_workflow(bits))(grid, ctx)
            out["dp"] = dp

        t0 = time.perf_counter()
        logging.getLogger("flwr").setLevel(logging.WARNING)
        run_simulation(server, client, num_supernodes=supernodes,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
        flower_secs.append(time.perf_counter() - t0)
        dp = out["dp"]
        rep = dp.report()
        accs.append(float(out["acc"][rounds]))
        print(f"    flower seed {seed}: acc {accs[-1]:.4f}, released {rep['released_rounds']}"
              f"/{rounds}, epsilon {rep['epsilon']:.3f}, {flower_secs[-1]:.0f} s", flush=True)
    gap, gap_se = _pairs(accs, ref)
    rows.append(_row(section="flower", dataset=spec, algorithm="fedavg",
                     mode=f"SecAgg+ {bits}b (Flower)", bits=bits, target_epsilon=epsilon,
                     epsilon_server=rep["epsilon"], epsilon_headline=rep["epsilon"],
                     heldout_accuracy=float(np.mean(accs)), accuracy_se=_se(accs),
                     seeds=seeds, per_seed=" ".join(f"{a:.4f}" for a in accs),
                     gap_to_central=gap, gap_se=gap_se, seconds=sum(flower_secs),
                     note=f"{supernodes} SuperNodes, run_simulation (Ray), noise from "
                          "SecureRandom on each node"))
    _show(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/distributed")
    ap.add_argument("--sections", default=",".join(s for s in SECTIONS if s not in DIAGNOSTICS),
                    help=f"comma-separated, of {', '.join(SECTIONS)} (default all but "
                         f"{' and '.join(DIAGNOSTICS)})")
    ap.add_argument("--quick", action="store_true",
                    help="one seed, epsilon 4, 30 (20) data rounds, a few bits, 6 SuperNodes")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 2; 1 "
                                                            "with --quick)")
    ap.add_argument("--supernodes", type=int, default=None,
                    help="Flower SuperNodes (default 20; 6 with --quick)")
    ap.add_argument("--flower-rounds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=0,
                    help="seeds of every cell start here (a fresh set of seeds checks that a "
                         "gap is not one set's luck)")
    ap.add_argument("--bits", default="16,20",
                    help="server, every-round: the moduli compared (comma-separated)")
    ap.add_argument("--epsilons", default=None,
                    help="target epsilons, comma-separated (default 2,4,8; 4 with --quick)")
    ap.add_argument("--algorithms", default="fedavg,upcycled",
                    help="server, every-round: fedavg, upcycled or both")
    args = ap.parse_args()
    try:
        bits_list = tuple(int(b) for b in args.bits.split(",") if b.strip())
    except ValueError:
        raise SystemExit(f"--bits: integers separated by commas, got {args.bits!r}") from None
    algorithms = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    if not bits_list or not algorithms or not set(algorithms) <= {"fedavg", "upcycled"}:
        raise SystemExit("--bits and --algorithms: at least one each; algorithms fedavg, "
                         f"upcycled (got {args.bits!r}, {args.algorithms!r})")
    torch.set_num_threads(1)
    seeds = args.seeds or (1 if args.quick else 2)
    if args.first_seed < 0:
        raise SystemExit(f"--first-seed: a non-negative integer, got {args.first_seed}")
    global FIRST_SEED
    FIRST_SEED = args.first_seed
    epsilons = (4.0,) if args.quick else (2.0, 4.0, 8.0)
    if args.epsilons is not None:
        try:
            epsilons = tuple(float(e) for e in args.epsilons.split(",") if e.strip())
        except ValueError:
            raise SystemExit(f"--epsilons: numbers separated by commas, got "
                             f"{args.epsilons!r}") from None
        if not epsilons or not all(math.isfinite(e) and e > 0 for e in epsilons):
            raise SystemExit(f"--epsilons: finite numbers > 0, got {args.epsilons!r}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for s in sections:
        if s not in SECTIONS:
            raise SystemExit(f"--sections: unknown {s!r} (one of {', '.join(SECTIONS)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if "server" in sections:
        print("server: both modes priced against the server (every round, no amplification)")
        rows += server_section(args.quick, epsilons, seeds, bits_list, algorithms)
    if "every-round" in sections:
        print("every-round: every client in every round (q = 1)")
        rows += every_round_section(args.quick, epsilons, seeds, bits_list, algorithms)
    if "control" in sections:
        print("control: central DP at the distributed mode's noise beside both (both settings)")
        rows += control_section(args.quick, epsilons, seeds, bits_list)
    if "twin" in sections:
        print("twin: the encoding alone (central DP's noise draws), against the server")
        rows += twin_section(args.quick, epsilons, seeds, bits_list, algorithms)
    if "bits" in sections:
        print("bits: accuracy against the modulus at epsilon 4 (server threat model)")
        rows += bits_section(args.quick, seeds)
    if "cost" in sections:
        print("cost: client-side encode against local training, per round")
        rows += cost_section(args.quick)
    if "flower" in sections:
        n = args.supernodes or (6 if args.quick else 20)
        print(f"flower: SecAgg+ with {n} SuperNodes against the trainer's central mode")
        rows += flower_section(args.quick, n, 8 if args.quick else args.flower_rounds, 8.0,
                               seeds)
    with open(out / "distributed.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {out / 'distributed.csv'} ({len(rows)} rows) in "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
