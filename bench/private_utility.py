"""Privacy-utility benchmark: held-out accuracy at epsilon 1, 2, 4, 8 beside the non-private
reference, for each trainer and privacy model, in one run (same data, seeds and settings).

Sections (``--sections``, comma-separated; all by default):

- ``client``: client-level DP-FedAvg (``--privacy client``) in Upcycled-FL and FedProx on
  2000 Synthetic clients (at most 500 records each, logistic regression), Poisson client
  rate q = 0.05, delta = 1e-5, **with the trainer's client-level defaults** (nothing tuned:
  adaptive clipping at the median from C = 1, server momentum 0.5, server learning rate 1;
  ``fl_examples.upcycled.config.CLIENT_DEFAULTS``), the same number of data rounds for both
  (Upcycled-FL's even iterations are free), and FedProx once more with as many iterations
  as Upcycled-FL (``fedprox (equal iterations)``: twice the data rounds, so more noise per
  round at the same epsilon); 3 seeds. Each private cell is paired by seed with the
  non-private run (``--privacy none``, the same local training, ``--fraction q``: the
  trainer's own aggregation, weighted by record counts, no server optimiser) and the gap
  printed per seed and as mean +- s.e.; on ``synthetic:iid`` also with the like-for-like
  reference (``reference``: DP-FedAvg's sampling, aggregation over q N and server optimiser,
  without clipping or noise), with Upcycled-FL at the issue's 60 data rounds, and with the
  previous defaults (a fixed clip C = 1, no server momentum). Two data sets:
  ``synthetic:iid`` (one shared model: learnable) and the issue's ``synthetic:0.5,0.5``,
  where every client draws its own random model; the centralised logistic-regression
  ceiling is printed beside it.
- ``bandmf``: banded matrix factorization (``--mechanism bandmf``) against DP-FedAvg under
  the same participation, FedAvg, at epsilon 2, 4 and 8: min-separation cohorts and cyclic
  groups (both unamplified; DP-FedAvg as b = 1 under the same schema), and amplified banded
  MF (cyclic groups with Poisson sampling inside) against DP-FedAvg with Poisson sampling
  (amplified), the same expected cohort; ``synthetic:iid`` over 2000 clients and digits over
  200, 3 seeds each. DP-FedAvg runs as banded MF does (a fixed clip norm, a plain server
  step), and once more with the trainer's DP-FedAvg defaults (``dpfedavg (Poisson,
  defaults)``: adaptive clipping from C = 1, server momentum 0.5).
- ``record``: record-level DP-SGD (``--privacy record``) in Upcycled-FL and FedProx on digits
  over 6 clients (about 270 records each), delta = 1e-5, beside the paper's output
  perturbation (sound replace-one sensitivity) at the same epsilon.
- ``scfl``: SCFL and FL-PMA with record-level DP-SGD on the client gradients
  (``--gradient-noise-for-epsilon``) on digits over 20 clients; the coded upload's MI-DP is
  priced apart and unchanged.
- ``mapa``: MAPA with Gaussian noise (``--noise gaussian``: record-level DP-SGD uploads on
  Poisson batches) on digits over 30 asynchronous edges, 2000 applied updates, z calibrated
  so that every edge's whole-run epsilon is at most the target (delta 1e-5), beside
  non-private ASGD with the same constant step.
- ``dprec``: DP-REC (replace-one, its only proven relation) and client-level DP-FedAvg
  (add-remove, Poisson rate 0.3) on digits over 100 clients, both calibrated to the same
  central epsilon with ``--epsilon``, beside non-private FedAvg (the trainer's defaults).
- ``opacus``: centralised DP-SGD on digits (1400 training records), privkit's batched solver
  against Opacus at the same epsilon, delta, clip, noise multiplier, Poisson rate and steps,
  logistic regression and the MLP, mean over seeds, with wall time (needs ``pip install
  opacus``; the section says so and is left out without it).

Writes ``OUT/private_utility.csv`` and ``OUT/private_utility.png``; prints the table.

    python bench/private_utility.py --out runs/private_utility          # the docs' table
    python bench/private_utility.py --quick                             # a smaller run
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import privkit  # noqa: E402
from fl_examples.core.data import parse_dataset_spec  # noqa: E402
from fl_examples.upcycled import UpcycledConfig, run_algorithm  # noqa: E402

EPSILONS = (1.0, 2.0, 4.0, 8.0)
SECTION_ORDER = ["client", "bandmf", "record", "scfl", "mapa", "dprec", "opacus"]
FIELDS = ["section", "dataset", "algorithm", "privacy", "target_epsilon", "epsilon",
          "delta", "heldout_accuracy", "accuracy_se", "seeds", "seconds", "gap", "gap_se",
          "gap_reference", "gap_reference_se", "per_seed", "note"]

#: The standard error over seeds of the last :func:`_fl` call's accuracy (for the rows).
_LAST_SE: list[float] = [float("nan")]
#: The per-seed accuracies of the last :func:`_fl` call (seed 0, 1, ...).
_LAST_ACCS: list[float] = []


def _row(**kw: Any) -> dict[str, Any]:
    out = {k: "" for k in FIELDS}
    out.update(kw)
    return out


#: FedProx run for as many iterations as Upcycled-FL (twice the data rounds): the
#: equal-iterations comparison beside the equal-data-rounds one.
EQUAL_ITERATIONS = "fedprox (equal iterations)"


def _fl(alg: str, cfg: UpcycledConfig, ds: Any, data_rounds: int, seeds: int
        ) -> tuple[float, float, float, float]:
    """(mean held-out accuracy, mean epsilon_max, delta, seconds) over seeds."""
    it = 2 * data_rounds - 1 if alg in ("upcycled", EQUAL_ITERATIONS) else data_rounds
    alg = "fedprox" if alg == EQUAL_ITERATIONS else alg
    accs, eps, delta = [], [], float("nan")
    t0 = time.perf_counter()
    for seed in range(seeds):
        c = UpcycledConfig(**(cfg.__dict__ | {"seed": seed, "iterations": it}))
        r = run_algorithm(alg, c, ds, iterations=it)
        accs.append(r["history"][-1]["heldout_accuracy"])
        if "privacy" in r:
            eps.append(r["privacy"]["epsilon_max"])
            delta = r["privacy"]["delta"]
    _LAST_SE[0] = float(np.std(accs, ddof=1) / math.sqrt(len(accs))) if len(accs) > 1 \
        else float("nan")
    _LAST_ACCS[:] = accs
    return (float(np.mean(accs)), float(np.mean(eps)) if eps else float("nan"), delta,
            time.perf_counter() - t0)


def _ceiling(ds: Any) -> float:
    """Test accuracy of centralised logistic regression on the pooled training data."""
    from sklearn.linear_model import LogisticRegression

    x, y = np.concatenate(ds.x_train), np.concatenate(ds.y_train)
    m = LogisticRegression(max_iter=300).fit(x[:100_000], y[:100_000])
    return float(m.score(np.concatenate(ds.x_test), np.concatenate(ds.y_test)))


def _gap(private: list[float], reference: list[float]) -> tuple[float, float, list[float]]:
    """Private minus non-private accuracy, paired by seed: (mean, s.e., per seed)."""
    d = [a - b for a, b in zip(private, reference)]
    se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(np.mean(d)), se, d


#: What the like-for-like reference changes in a client-level run: no clipping (C = 1e6)
#: and no noise (z = 1e-12: stddev 1e-6 on the sum), a fixed clip; everything else (Poisson
#: sampling, the sum over q N, the server optimiser) is DP-FedAvg's.
REFERENCE = dict(privacy="client", l2_clip_norm=1e6, noise_multiplier=1e-12, adaptive_clip=0.0)
#: The client-level defaults before this bench's table (fixed clip 1, plain server step).
PREVIOUS_DEFAULTS = dict(adaptive_clip=0.0, server_momentum=0.0, server_lr=1.0)


def client_section(quick: bool, epsilons: tuple[float, ...]) -> list[dict[str, Any]]:
    """Client-level DP-FedAvg with the trainer's defaults (module docstring)."""
    rounds, seeds = (30, 1) if quick else (100, 3)
    specs = ["synthetic:iid@2000/500"] + ([] if quick else ["synthetic:0.5,0.5@2000/500"])
    q = 0.05
    rows = []
    for spec in specs:
        ds = parse_dataset_spec(spec, seed=0)
        ceiling = _ceiling(ds)
        base = dict(dataset=spec, mu=0.01, lam=0.04, local_epochs=5, batch_size=32, lr=0.05,
                    momentum=0.5, stragglers=0.0, fraction=q, device="cpu", eval_every=10**6)
        iid = spec.startswith("synthetic:iid")
        # (label, algorithm, data rounds, the private runs' extra settings)
        runs: list[tuple[str, str, int, dict[str, Any]]] = [
            ("upcycled", "upcycled", rounds, {}), ("fedprox", "fedprox", rounds, {})]
        if iid:
            runs.append((EQUAL_ITERATIONS, EQUAL_ITERATIONS, rounds, {}))
            if not quick:  # the setting, and the previous defaults
                runs += [("upcycled (60 data rounds)", "upcycled", 60, {}),
                         ("upcycled (60, previous defaults)", "upcycled", 60,
                          PREVIOUS_DEFAULTS),
                         ("upcycled (previous defaults)", "upcycled", rounds,
                          PREVIOUS_DEFAULTS)]
        plain: dict[tuple[str, int], list[float]] = {}
        like: dict[tuple[str, int, str], list[float]] = {}
        for label, alg, n, extra in runs:
            note = (f"{n} data rounds, q {q:g}, the client-level defaults"
                    + (" but " + ", ".join(f"{k} {v:g}" for k, v in extra.items())
                       if extra else "") + f"; centralised LR ceiling {ceiling:.3f}")
            key = (alg, n)
            if key not in plain:  # the non-private run (--privacy none), once per (alg, n)
                acc, _, _, secs = _fl(alg, UpcycledConfig(**base), ds, n, seeds)
                plain[key] = list(_LAST_ACCS)
                rows.append(_row(section="client", dataset=spec, algorithm=label,
                                 privacy="none", heldout_accuracy=acc,
                                 accuracy_se=_LAST_SE[0], seeds=seeds, seconds=secs,
                                 per_seed=_seeds_text(plain[key]),
                                 note=f"{n} data rounds, --privacy none --fraction {q:g}"))
                _show(rows[-1])
            server = {k: v for k, v in extra.items() if k.startswith("server_")}
            rkey = (alg, n, repr(server))
            if iid and rkey not in like:  # DP-FedAvg without clipping or noise
                acc, _, _, secs = _fl(alg, UpcycledConfig(**base, **REFERENCE, client_rate=q,
                                                          **server), ds, n, seeds)
                like[rkey] = list(_LAST_ACCS)
                rows.append(_row(section="client", dataset=spec, algorithm=label,
                                 privacy="reference", heldout_accuracy=acc,
                                 accuracy_se=_LAST_SE[0], seeds=seeds, seconds=secs,
                                 per_seed=_seeds_text(like[rkey]),
                                 note=f"{n} data rounds, DP-FedAvg's aggregation and server "
                                      "optimiser without clipping or noise"))
                _show(rows[-1])
            for e in epsilons:
                cfg = UpcycledConfig(**base, privacy="client", noise_for_epsilon=e,
                                     client_rate=q, **extra)
                acc, eps, d, secs = _fl(alg, cfg, ds, n, seeds)
                g, g_se, per = _gap(_LAST_ACCS, plain[key])
                row = _row(section="client", dataset=spec, algorithm=label, privacy="client",
                           target_epsilon=e, epsilon=eps, delta=d, heldout_accuracy=acc,
                           accuracy_se=_LAST_SE[0], seeds=seeds, seconds=secs, gap=g,
                           gap_se=g_se, per_seed=_seeds_text(_LAST_ACCS), note=note)
                text = f"    gap to --privacy none: {_gaps_text(g, g_se, per)}"
                if iid:
                    g2, g2_se, per2 = _gap(_LAST_ACCS, like[rkey])
                    row |= dict(gap_reference=g2, gap_reference_se=g2_se)
                    text += f"; to the reference: {_gaps_text(g2, g2_se, per2)}"
                rows.append(row)
                _show(rows[-1])
                print(text, flush=True)
    return rows


def _pm(mean: float, se: float) -> str:
    """Points: mean +- s.e. (the s.e. left out for one seed)."""
    return f"{100 * mean:+.1f}" + (f"+-{100 * se:.1f}" if math.isfinite(se) else "")


def _seeds_text(accs: list[float]) -> str:
    return " ".join(f"{a:.4f}" for a in accs)


def _gaps_text(mean: float, se: float, per: list[float]) -> str:
    """Points, per seed and mean +- s.e."""
    seeds = " ".join(f"{100 * d:+.1f}" for d in per)
    se_text = f" +- {100 * se:.1f}" if math.isfinite(se) else ""
    return f"{100 * mean:+.1f}{se_text} points (seeds {seeds})"


#: Banded MF runs: (label, settings). b = 1 is DP-FedAvg's independent noise under the same
#: participation (unamplified: its only sound price there); ``gaussian`` is DP-FedAvg with
#: Poisson sampling (amplified).
def _banded_settings(bands: int, amp_bands: int, q: float) -> list[tuple[str, str, dict]]:
    return [
        ("minsep", f"bandmf b={bands}", dict(mechanism="bandmf", bands=bands,
                                             participation="minsep", client_rate=q)),
        ("minsep", "dpfedavg (b=1)", dict(mechanism="bandmf", bands=1, min_separation=bands,
                                          participation="minsep", client_rate=q)),
        ("cyclic", f"bandmf b={bands}", dict(mechanism="bandmf", bands=bands, groups=bands,
                                             participation="cyclic")),
        ("cyclic", "dpfedavg (b=1)", dict(mechanism="bandmf", bands=1, groups=bands,
                                          participation="cyclic")),
        ("poisson", f"bandmf b={amp_bands}", dict(mechanism="bandmf", bands=amp_bands,
                                                  groups=amp_bands, participation="poisson",
                                                  client_rate=min(1.0, q * amp_bands))),
        ("poisson", "bandmf b by RMSE", {}),  # filled per epsilon: _rmse_bands
        ("poisson", "dpfedavg (Poisson)", FIXED_CLIP | dict(client_rate=q)),
        ("poisson", "dpfedavg (Poisson, defaults)", dict(mechanism="gaussian", client_rate=q,
                                                         l2_clip_norm=None)),
    ]


#: DP-FedAvg as banded MF runs it: a fixed clip norm and a plain server step (like for like;
#: the row ``dpfedavg (Poisson, defaults)`` has the trainer's defaults: adaptive clipping from
#: C = 1 and server momentum 0.5).
FIXED_CLIP = dict(mechanism="gaussian", adaptive_clip=0.0, server_momentum=0.0)


def _rmse_bands(rounds: int, q: float, epsilon: float, delta: float,
                candidates: tuple[int, ...] = (1, 2, 4, 8, 16)) -> tuple[int, float]:
    """Amplified banded MF's b (= its groups, each member at rate q b: the expected cohort of
    DP-FedAvg at q) minimising the prefix sums' RMSE z(b) * workload_error(b) at the target
    epsilon: a choice from public settings only, as Choquette-Choo et al. (NeurIPS 2023)
    choose b. b = 1 is DP-FedAvg with Poisson sampling."""
    from privkit.accountants.bandmf import CyclicPoisson, calibrate_bandmf
    from privkit.mechanisms.bandmf import BandedToeplitzStrategy

    best: tuple[float, int] | None = None
    for b in candidates:
        if b > rounds or q * b > 1:
            continue
        st = BandedToeplitzStrategy.identity() if b == 1 else \
            BandedToeplitzStrategy.optimized(b, rounds)
        z = calibrate_bandmf(st, target_epsilon=epsilon, delta=delta, rounds=rounds,
                             participation=CyclicPoisson(b, q * b)).noise_multiplier
        rmse = z * st.workload_error(rounds)
        if best is None or rmse < best[0]:
            best = (rmse, b)
    assert best is not None
    return best[1], best[0]


def bandmf_section(quick: bool, epsilons: tuple[float, ...]) -> list[dict[str, Any]]:
    """Banded MF (DP-FTRL) against DP-FedAvg under the same participation, FedAvg.

    ``minsep``: cohorts of q N among clients not in the last b - 1 rounds; ``cyclic``: b
    groups by id, round t serves group t mod b; both priced without amplification (the
    server knows who took part), DP-FedAvg as b = 1 under the same schema. ``poisson``:
    amplified banded MF (b groups, each member with probability q b) against DP-FedAvg with
    Poisson sampling at q over everyone (the same expected cohort)."""
    eps_here = tuple(e for e in epsilons if e >= 2) or epsilons
    setups = [
        # (spec, data rounds, q, clip, local epochs, batch, lr, bands, amplified bands, seeds)
        ("synthetic:iid@2000/500", 30 if quick else 100, 0.05, 3.0, 5, 32, 0.05, 16, 8,
         1 if quick else 3),
        ("digits:iid@200", 30 if quick else 60, 0.1, 1.0, 5, 16, 0.1, 8, 8,
         1 if quick else 3),
    ]
    rows = []
    for spec, rounds, q, clip, epochs, batch, lr, bands, amp, seeds in setups:
        ds = parse_dataset_spec(spec, seed=0)
        base = dict(dataset=spec, mu=0.01, lam=0.04, local_epochs=epochs, batch_size=batch,
                    lr=lr, momentum=0.5, stragglers=0.0, fraction=q, device="cpu",
                    eval_every=10**6)
        note = (f"FedAvg, {rounds} data rounds, expected cohort {q * ds.num_clients:g}, clip "
                f"{clip:g}, {seeds} seed(s)")
        acc, _, _, secs = _fl("fedavg", UpcycledConfig(**base), ds, rounds, seeds)
        rows.append(_row(section="bandmf", dataset=spec, algorithm="fedavg", privacy="none",
                         heldout_accuracy=acc, accuracy_se=_LAST_SE[0], seeds=seeds,
                         seconds=secs, note=note))
        _show(rows[-1])
        for part, label, settings in _banded_settings(bands, amp, q):
            for e in eps_here:
                extra, kw = "", settings
                if not kw:  # b chosen from public settings by the prefix sums' RMSE
                    b, rmse = _rmse_bands(rounds, q, e, 1e-5)
                    extra = f"; b = {b} by RMSE ({rmse:.3g})"
                    kw = FIXED_CLIP | dict(client_rate=q) if b == 1 else dict(
                        mechanism="bandmf", bands=b, groups=b, participation="poisson",
                        client_rate=q * b)
                cfg = UpcycledConfig(**(base | dict(privacy="client", noise_for_epsilon=e,
                                                    l2_clip_norm=clip) | kw))
                acc, eps, d, secs = _fl("fedavg", cfg, ds, rounds, seeds)
                if "defaults" in label:
                    extra = "; the DP-FedAvg defaults: adaptive clipping from C = 1"
                rows.append(_row(section="bandmf", dataset=spec, algorithm=label,
                                 privacy=part, target_epsilon=e, epsilon=eps, delta=d,
                                 heldout_accuracy=acc, accuracy_se=_LAST_SE[0], seeds=seeds,
                                 seconds=secs, per_seed=_seeds_text(_LAST_ACCS),
                                 note=note + extra))
                _show(rows[-1])
    return rows


def record_section(quick: bool, epsilons: tuple[float, ...]) -> list[dict[str, Any]]:
    rounds, seeds = (10, 1) if quick else (20, 3)
    spec = "digits:iid@6"
    ds = parse_dataset_spec(spec, seed=0)
    base = dict(dataset=spec, mu=0.01, lam=0.04, local_epochs=1, batch_size=32, lr=0.1,
                momentum=0.5, stragglers=0.0, fraction=1.0, device="cpu", eval_every=10**6)
    note = f"{rounds} data rounds, 6 clients of {min(ds.train_sizes)}-{max(ds.train_sizes)} records"
    rows = []
    for alg in ("upcycled", "fedprox"):
        acc, _, _, secs = _fl(alg, UpcycledConfig(**base), ds, rounds, seeds)
        rows.append(_row(section="record", dataset=spec, algorithm=alg, privacy="none",
                         heldout_accuracy=acc, seeds=seeds, seconds=secs, note=note))
        _show(rows[-1])
        for kind, extra in (("record", dict(l2_clip_norm=1.0)),
                            ("output", dict(l2_clip_norm=10.0, sensitivity="replace-one"))):
            for e in epsilons:
                cfg = UpcycledConfig(**base, privacy=kind, noise_for_epsilon=e,
                                     noise_target="max", delta=1e-5, **extra)
                acc, eps, d, secs = _fl(alg, cfg, ds, rounds, seeds)
                rows.append(_row(section="record", dataset=spec, algorithm=alg, privacy=kind,
                                 target_epsilon=e, epsilon=eps, delta=d, heldout_accuracy=acc,
                                 seeds=seeds, seconds=secs, note=note))
                _show(rows[-1])
    return rows


def scfl_section(quick: bool, epsilons: tuple[float, ...]) -> list[dict[str, Any]]:
    """SCFL and FL-PMA with record-level DP-SGD on the client gradients (the coded upload's
    MI-DP is separate and unchanged; FL-PMA uploads nothing coded)."""
    from fl_examples.scfl import ScflConfig
    from fl_examples.scfl import train as scfl_train

    rounds = 30 if quick else 100
    base = dict(dataset="digits", clients=20, rounds=rounds, eval_every=rounds,
                batch_sampling="bernoulli")
    note = f"{rounds} epochs, 20 clients, Poisson batches of 16, clip 1; coded upload MI-DP apart"
    rows = []
    settings: list[tuple[str, float | None]] = [("none", None)]
    settings += [("record", e) for e in epsilons]
    for kind, e in settings:
        t0 = time.perf_counter()
        cfg = ScflConfig(**base, gradient_noise_for_epsilon=e)
        res = scfl_train(cfg, algorithms="scfl,fl-pma")["algorithms"]
        secs = time.perf_counter() - t0
        for alg, r in res.items():
            p = r.get("gradient_privacy", {})
            rows.append(_row(section="scfl", dataset="digits (20 clients)", algorithm=alg,
                             privacy=kind, target_epsilon="" if e is None else e,
                             epsilon=p.get("epsilon_max", ""), delta=p.get("delta", ""),
                             heldout_accuracy=r["history"][-1]["heldout_accuracy"], seeds=1,
                             seconds=secs / len(res), note=note))
            _show(rows[-1])
    return rows


def mapa_section(quick: bool, epsilons: tuple[float, ...]) -> list[dict[str, Any]]:
    """MAPA with Gaussian noise (calibrated per edge) and non-private ASGD, digits, 30 edges."""
    from fl_examples.mapa import MapaConfig, load_edges
    from fl_examples.mapa import run_algorithm as mapa_run

    updates, seeds = (1000, 1) if quick else (2000, 2)
    note = f"{updates} updates, 30 edges, Poisson batches of 24, clip 1, lr 0.1"
    rows = []
    settings: list[tuple[str, float | None]] = [("none", None)]
    settings += [("record", e) for e in epsilons]
    for kind, e in settings:
        accs, eps, t0 = [], [], time.perf_counter()
        alg = "asgd" if e is None else "mapa"
        for seed in range(seeds):
            kw = {} if e is None else {"noise_for_epsilon": e}
            cfg = MapaConfig(noise="gaussian", updates=updates, eval_every=updates, seed=seed,
                             **kw)
            ds = load_edges(cfg.dataset, edges=cfg.edges, seed=seed)
            r = mapa_run(alg, cfg, dataset=ds)
            accs.append(r["history"][-1]["heldout_accuracy"])
            if "privacy" in r:
                eps.append(r["privacy"]["epsilon_max"])
        rows.append(_row(section="mapa", dataset="digits (30 edges)", algorithm=alg,
                         privacy=kind, target_epsilon="" if e is None else e,
                         epsilon=max(eps) if eps else "", delta=1e-5 if eps else "",
                         heldout_accuracy=float(np.mean(accs)), seeds=seeds,
                         seconds=(time.perf_counter() - t0) / seeds, note=note))
        _show(rows[-1])
    return rows


def dprec_section(quick: bool, epsilons: tuple[float, ...]) -> list[dict[str, Any]]:
    """DP-REC and DP-FedAvg at the same central epsilon beside FedAvg (the defaults)."""
    from fl_examples.dprec import DPRecConfig
    from fl_examples.dprec import train as dprec_train

    seeds = 1 if quick else 3
    note = "100 clients, 30 draws / rate 0.3, 50 rounds, 5 local epochs, clip 0.5"
    rows = []
    ref: list[float] = []
    per: dict[tuple[str, float], list[tuple[float, float, float]]] = {}
    for e in epsilons:
        for seed in range(seeds):
            t0 = time.perf_counter()
            res = dprec_train(DPRecConfig(epsilon=e, seed=seed, device="cpu", eval_every=50),
                              compare=("dpfedavg",) + (("fedavg",) if e == epsilons[0]
                                                       else ()))["algorithms"]
            secs = (time.perf_counter() - t0) / len(res)
            for alg, r in res.items():
                acc = r["history"][-1]["heldout_accuracy"]
                if alg == "fedavg":
                    ref.append(acc)
                    continue
                per.setdefault((alg, e), []).append(
                    (acc, r["privacy"]["epsilon_central"], secs))
    rows.append(_row(section="dprec", dataset="digits (100 clients)", algorithm="fedavg",
                     privacy="none", heldout_accuracy=float(np.mean(ref)), seeds=seeds,
                     seconds=float("nan"), note=note))
    _show(rows[-1])
    for (alg, e), vals in per.items():
        kind = "client"
        rows.append(_row(section="dprec", dataset="digits (100 clients)", algorithm=alg,
                         privacy=kind, target_epsilon=e, epsilon=max(v[1] for v in vals),
                         delta=1e-5, heldout_accuracy=float(np.mean([v[0] for v in vals])),
                         seeds=seeds, seconds=float(np.mean([v[2] for v in vals])),
                         note=note + ("; replace-one" if alg == "dprec" else "; add-remove")))
        _show(rows[-1])
    return rows


def opacus_section(quick: bool, epsilons: tuple[float, ...]) -> list[dict[str, Any]]:
    try:
        import opacus  # noqa: F401
    except ImportError:
        print("opacus section left out: pip install opacus (a bench-only dependency)")
        return []
    import _opacus_ref as ref

    data = ref.digits_pooled()
    n, batch, epochs = len(data[1]), 50, 10
    steps = ref.steps(n, batch, epochs)
    q = batch / n
    seeds = 2 if quick else 12
    settings = {"logreg": dict(lr=0.5, clip=1.0, momentum=0.9),
                "mlp": dict(lr=0.5, clip=1.0, momentum=0.9)}
    rows = []
    for name, s in settings.items():
        # the non-private reference: the same solver and Poisson batches, no clip, no noise
        t0 = time.perf_counter()
        plain = [ref.privkit_run(name, data, z=1e-12, batch=batch, epochs=epochs, seed=seed,
                                 lr=s["lr"], clip=1e12, momentum=s["momentum"])[0]
                 for seed in range(seeds)]
        rows.append(_row(section="opacus", dataset="digits (1 client)",
                         algorithm=f"{name} privkit", privacy="none",
                         heldout_accuracy=float(np.mean(plain)), seeds=seeds,
                         seconds=time.perf_counter() - t0, note="no clipping, no noise"))
        _show(rows[-1])
        for e in epsilons:
            z = privkit.calibrate_noise(
                lambda x: privkit.SelfComposedDpEvent(
                    privkit.PoissonSampledDpEvent(q, privkit.GaussianDpEvent(x)), steps),
                target_epsilon=e, delta=1e-5)[0]
            ours, theirs, t_ours, t_theirs, eps_theirs = [], [], 0.0, 0.0, 0.0
            for seed in range(seeds):
                a, ta = ref.privkit_run(name, data, z=z, batch=batch, epochs=epochs, seed=seed,
                                        **s)
                b, tb, eb = ref.opacus_run(name, data, z=z, batch=batch, epochs=epochs,
                                           seed=seed, **s)
                ours.append(a)
                theirs.append(b)
                t_ours += ta
                t_theirs += tb
                eps_theirs = eb
            eps_ours = privkit.epsilon(privkit.SelfComposedDpEvent(
                privkit.PoissonSampledDpEvent(q, privkit.GaussianDpEvent(z)), steps),
                1e-5).epsilon
            diff = np.array(ours) - np.array(theirs)  # paired by seed (same initial model)
            se = float(diff.std(ddof=1) / math.sqrt(seeds)) if seeds > 1 else float("nan")
            note = (f"z {z:.4f}, q {q:.4g}, {steps} steps, clip {s['clip']}, lr {s['lr']}; "
                    f"accuracy std privkit {np.std(ours):.3f} opacus {np.std(theirs):.3f}; "
                    f"paired difference {diff.mean():+.4f} +- {se:.4f} (s.e.)")
            for impl, acc, secs, eps in (("privkit", ours, t_ours, eps_ours),
                                         ("opacus", theirs, t_theirs, eps_theirs)):
                rows.append(_row(section="opacus", dataset="digits (1 client)",
                                 algorithm=f"{name} {impl}", privacy="record",
                                 target_epsilon=e, epsilon=eps, delta=1e-5,
                                 heldout_accuracy=float(np.mean(acc)), seeds=seeds, seconds=secs,
                                 note=note))
                _show(rows[-1])
            print(f"    speed: privkit {t_theirs / t_ours:.2f}x Opacus's "
                  f"({t_ours:.2f} s vs {t_theirs:.2f} s); accuracy difference "
                  f"{diff.mean():+.4f} +- {se:.4f} (s.e., paired over {seeds} seeds)",
                  flush=True)
    return rows


def _show(r: dict[str, Any]) -> None:
    e = ("" if r["target_epsilon"] == ""
         else f"eps {r['epsilon']:.3f} (target {r['target_epsilon']:g})")
    se = r.get("accuracy_se")
    se_text = f" (s.e. {se:.4f})" if isinstance(se, float) and math.isfinite(se) else ""
    print(f"  {r['section']:<7} {r['dataset']:<28} {r['algorithm']:<32} {r['privacy']:<9} "
          f"{e:<26} acc {r['heldout_accuracy']:.4f}{se_text}  {r['seconds']:.1f} s"
          + (f"  [{r['note'].split('; ', 1)[1]}]" if "; b = " in str(r.get("note")) else ""),
          flush=True)


#: Rows drawn as horizontal lines: the non-private run and, at client level, DP-FedAvg
#: without clipping or noise.
REFS = ("none", "reference")


def _panel(r: dict[str, Any]) -> tuple[str, str]:
    """(section, title) of a row's panel: the client section's runs at the issue's 60 data
    rounds get a panel of their own beside the data set's."""
    if r["section"] == "client" and "(60" in str(r["algorithm"]):
        return r["section"], f"{r['dataset']}, 60 data rounds"
    return r["section"], r["dataset"]


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(_panel(r) for r in rows))  # run order
    panels.sort(key=lambda p: SECTION_ORDER.index(p[0]))
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.8 * ncols, 3.9 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    styles = [("-", "o"), (":", "s"), ("-.", "^")]
    for ax, (sec, ds) in zip(axes.flat, panels):
        here = [r for r in rows if _panel(r) == (sec, ds)]
        # one colour per algorithm (its non-private line too), one line style per privacy model
        algs = list(dict.fromkeys(r["algorithm"] for r in here))
        kinds = list(dict.fromkeys(r["privacy"] for r in here if r["privacy"] not in REFS))
        lines = list(dict.fromkeys((r["algorithm"], r["privacy"]) for r in here
                                   if r["privacy"] not in REFS))
        for alg, kind in lines:
            pts = sorted((float(r["target_epsilon"]), float(r["heldout_accuracy"])) for r in here
                         if r["algorithm"] == alg and r["privacy"] == kind)
            ls, mk = styles[kinds.index(kind) % len(styles)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=mk,
                    color=f"C{algs.index(alg)}", label=f"{alg} ({kind})")
        for r in (r for r in here if r["privacy"] in REFS):
            ref = r["privacy"] == "reference"
            ax.axhline(float(r["heldout_accuracy"]), ls=":" if ref else "--",
                       color=f"C{algs.index(r['algorithm'])}", alpha=0.6,
                       label=f"{r['algorithm']} " + ("reference (no clip, no noise)" if ref
                                                     else "non-private"))
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(EPSILONS), [f"{e:g}" for e in EPSILONS])
        ax.set_xlabel("epsilon (delta 1e-5)")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"{sec}: {ds}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if len(here) < 20 else 5.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/private_utility")
    ap.add_argument("--sections", default=",".join(SECTION_ORDER))
    ap.add_argument("--quick", action="store_true",
                    help="fewer rounds and seeds, epsilon 1 and 8 only (make bench)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sections = {"client": client_section, "bandmf": bandmf_section, "record": record_section,
                "scfl": scfl_section,
                "mapa": mapa_section, "dprec": dprec_section, "opacus": opacus_section}
    chosen = [s.strip() for s in a.sections.split(",") if s.strip()]
    for s in chosen:
        if s not in sections:
            ap.error(f"--sections: unknown section {s!r} (choose from {', '.join(sections)})")
    epsilons = (1.0, 8.0) if a.quick else EPSILONS
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for s in chosen:
        print(f"== {s}", flush=True)
        rows += sections[s](a.quick, epsilons)
    with open(out / "private_utility.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    if rows:
        _plot(rows, out / "private_utility.png")
    print(f"\nwrote {out / 'private_utility.csv'} and {out / 'private_utility.png'} "
          f"({time.perf_counter() - t0:.0f} s, torch threads 1)")
    _summary(rows)


def _summary(rows: list[dict[str, Any]]) -> None:
    """The table: accuracy per epsilon beside the non-private reference (and, where a section
    pairs them by seed, the gap to it in points, mean +- s.e.)."""
    keys = []
    for r in rows:
        k = (r["section"], r["dataset"], r["algorithm"], r["privacy"])
        if r["privacy"] not in REFS and k not in keys:
            keys.append(k)
    ref = {(r["section"], r["dataset"], r["algorithm"]): r["heldout_accuracy"]
           for r in rows if r["privacy"] == "none"}
    like = {(r["section"], r["dataset"], r["algorithm"]): r["heldout_accuracy"]
            for r in rows if r["privacy"] == "reference"}
    eps = sorted({r["target_epsilon"] for r in rows if r["target_epsilon"] != ""})
    print(f"\n{'section':<7} {'dataset':<28} {'algorithm':<32} {'privacy':<7} "
          + " ".join(f"{'eps ' + format(e, 'g'):>8}" for e in eps) + f" {'non-priv':>8}"
          + f" {'ref':>8}")
    gaps = []
    for k in keys:
        here = [r for r in rows if (r["section"], r["dataset"], r["algorithm"], r["privacy"]) == k]
        accs = {r["target_epsilon"]: r["heldout_accuracy"] for r in here}
        nonpriv = ref.get(k[:3])
        if nonpriv is None and here[0].get("gap") != "":  # paired with another label's run
            nonpriv = here[0]["heldout_accuracy"] - here[0]["gap"]
        if nonpriv is None:  # the section's own non-private reference (ASGD, FedAvg)
            same = [v for (sec, ds, _), v in ref.items() if (sec, ds) == k[:2]]
            nonpriv = same[0] if len(same) == 1 else None
        cells = " ".join(f"{accs[e]:>8.3f}" if e in accs else f"{'':>8}" for e in eps)
        print(f"{k[0]:<7} {k[1]:<28} {k[2]:<32} {k[3]:<7} {cells} "
              + (f"{nonpriv:>8.3f}" if nonpriv is not None and not math.isnan(nonpriv)
                 else f"{'':>8}")
              + (f" {like[k[:3]]:>8.3f}" if k[:3] in like else ""))
        if any(r.get("gap") != "" for r in here):
            gaps.append((k, {r["target_epsilon"]: r for r in here}))
    if not gaps:
        return
    print("\nprivate minus non-private, points, mean +- s.e. over seeds (paired by seed); "
          "[to the reference: DP-FedAvg without clipping or noise]")
    for k, by_eps in gaps:
        gap_cells: list[str] = []
        for e in eps:
            g = by_eps.get(e)
            if g is None or g.get("gap") == "":
                gap_cells.append(f"{'':>21}")
                continue
            cell = _pm(g["gap"], g["gap_se"])
            if g.get("gap_reference") != "":
                cell += f" [{_pm(g['gap_reference'], g['gap_reference_se'])}]"
            gap_cells.append(f"{cell:>21}")
        print(f"{k[0]:<7} {k[1]:<28} {k[2]:<32} " + " ".join(gap_cells))


if __name__ == "__main__":
    main()
