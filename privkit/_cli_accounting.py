"""``privkit epsilon``, ``privkit calibrate`` and ``privkit midp``: the accounting commands.

Their parsers (the run's schedule, the method, the neighbouring relation) and what they
print. Apart from :mod:`privkit.cli`, which builds the whole command line and dispatches,
because these commands only price events: they share the schedule and relation options with
each other and nothing with the audit or ledger commands.
"""

from __future__ import annotations

import argparse
from typing import Any

from privkit import _validate
from privkit._cli_base import add_json, emit, integer_or_number, number, subcommands
from privkit.accountants import Method, NeighboringRelation, epsilon
from privkit.accountants.accountant import relation_label
from privkit.accountants.calibration import calibrate_noise_multiplier, calibrate_steps
from privkit.accountants.schedule import schedule
from privkit.errors import InvalidParameterError
from privkit.events import NOISE_MULTIPLIER_NOTE, gaussian_steps_event, pure_steps_event

__all__ = ["add_epsilon_parser", "add_calibrate_parser", "add_midp_parser", "run_epsilon",
           "run_calibrate", "run_midp"]


def _methods() -> list[str]:
    """The methods that price Gaussian steps (the pure-DP ones are ``epsilon pure``'s)."""
    return [m.value for m in Method if m.value not in ("optimal", "advanced", "basic")]


def _check_gaussian_method(method: str, sampling_probability: float | None) -> None:
    """exact and moments price Gaussian steps without sampling: say so naming --method."""
    if method in ("exact", "moments") and (sampling_probability is None
                                           or sampling_probability < 1):
        q = "" if sampling_probability is None else f"q = {sampling_probability:g}; "
        raise InvalidParameterError(
            "method", method, "auto, pld, pld-fft or rdp when steps are sampled "
            f"({q}{method} prices Gaussian steps without sampling)")


_METHOD_HELP = ("accounting method: exact, pld / pld-fft (privacy-loss distributions), rdp, "
                "moments; auto: the tightest valid bound")


_RELATIONS = {"add-remove": "ADD_OR_REMOVE_ONE", "replace-one": "REPLACE_ONE",
              "zero-out": "REPLACE_SPECIAL"}


def _add_delta(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delta", type=number, required=True,
                        help="the delta in (0, 1) the epsilon holds at")


def _add_noise_multiplier(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--noise-multiplier", type=number, required=True,
                        help="stddev / L2 sensitivity (z)")


def _add_relation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--relation", default="add-remove", choices=list(_RELATIONS),
        help="neighbouring relation to price under: add-remove (one record added or removed; "
        "sensitivity C), zero-out (one record replaced by a null one that contributes "
        "nothing; C) or replace-one (one record replaced by another; 2C). "
        "--noise-multiplier is stddev / C (C the clip norm) under every relation, as in "
        "Opacus and dp-accounting's PLD")


def _add_schedule(parser: argparse.ArgumentParser, *, steps: bool) -> None:
    """The run's length (``--steps`` or ``--epochs``) and its sampling probability
    (``--sampling-probability`` or ``--batch-size`` with ``--dataset-size``)."""
    if steps:
        length = parser.add_mutually_exclusive_group(required=True)
        length.add_argument("--steps", type=integer_or_number, help="number of releases T")
        length.add_argument("--epochs", type=number,
                            help="passes over the data instead of --steps (Opacus style)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--sampling-probability", type=number, default=None,
                      help="Poisson sampling probability q in (0, 1] (default 1: no sampling, "
                      "or batch size / dataset size)")
    rate.add_argument("--batch-size", type=integer_or_number,
                      help="expected batch size B (Poisson sampling at q = B / N; needs "
                      "--dataset-size)")
    parser.add_argument("--dataset-size", type=integer_or_number,
                        help="number of records N (with --batch-size)")


def add_epsilon_parser(sub: Any) -> None:
    """``privkit epsilon gaussian`` and ``privkit epsilon pure``."""
    eps_sub = subcommands(sub, "epsilon", "epsilon for given settings")
    g = eps_sub.add_parser(
        "gaussian", help="(subsampled) Gaussian steps",
        description="The epsilon of a run of (Poisson-subsampled) Gaussian steps at noise "
        "multiplier z (stddev / sensitivity under --relation), given by --steps or by "
        "--epochs, exactly as 'privkit calibrate gaussian' takes them (one epoch is "
        "ceil(N / B) steps with --batch-size B and --dataset-size N, ceil(1 / q) with "
        "--sampling-probability q; rounded up).")
    _add_noise_multiplier(g)
    _add_schedule(g, steps=True)
    _add_delta(g)
    g.add_argument("--method", default="auto", choices=_methods(), help=_METHOD_HELP)
    _add_relation(g)
    add_json(g)

    pu = eps_sub.add_parser("pure", help="k-fold composition of epsilon0-DP steps")
    pu.add_argument("--epsilon", type=number, required=True, help="per-step epsilon0")
    pu.add_argument("--steps", type=integer_or_number, required=True, help="number of steps k")
    _add_delta(pu)
    pu.add_argument("--method", default="auto", choices=["auto", "optimal", "advanced", "basic",
                                                          "pld", "rdp"],
                    help="optimal, advanced or basic composition, a PLD or RDP; auto: the "
                    "tightest")
    add_json(pu)


def add_calibrate_parser(sub: Any) -> None:
    """``privkit calibrate gaussian`` (the noise) and ``privkit calibrate steps``."""
    cal_sub = subcommands(sub, "calibrate", "noise (or steps) for a target epsilon")
    cg = cal_sub.add_parser(
        "gaussian", help="noise multiplier for (subsampled) Gaussian steps",
        description="The smallest noise multiplier z (stddev / sensitivity under --relation) "
        "whose verified epsilon is at most the target, for a run given by --steps or by "
        "--epochs (one epoch is ceil(N / B) steps with --batch-size B and --dataset-size N, "
        "ceil(1 / q) with --sampling-probability q; rounded up).")
    cg.add_argument("--target-epsilon", type=number, required=True,
                    help="the epsilon the noise must reach (the result never exceeds it)")
    _add_delta(cg)
    _add_schedule(cg, steps=True)
    cg.add_argument("--method", default="auto", choices=_methods(),
                    help=_METHOD_HELP + " (it both solves and verifies)")
    _add_relation(cg)
    add_json(cg)
    cs = cal_sub.add_parser(
        "steps", help="the most (subsampled) Gaussian steps within a target epsilon",
        description="The largest number of steps at noise multiplier z (stddev / sensitivity "
        "under --relation) whose verified epsilon is at most the target, and the epochs they "
        "make.")
    _add_noise_multiplier(cs)
    cs.add_argument("--target-epsilon", type=number, required=True,
                    help="the epsilon the steps must stay within")
    _add_delta(cs)
    _add_schedule(cs, steps=False)
    cs.add_argument("--method", default="auto", choices=_methods(), help=_METHOD_HELP)
    _add_relation(cs)
    add_json(cs)


def run_epsilon(a: argparse.Namespace) -> None:
    run = ""
    if a.mechanism == "gaussian":
        sched = schedule(steps=a.steps, epochs=a.epochs,
                         sampling_probability=a.sampling_probability,
                         batch_size=a.batch_size, dataset_size=a.dataset_size)
        _check_gaussian_method(a.method, sched.sampling_probability)
        ev = gaussian_steps_event(a.noise_multiplier, sched.steps, sched.sampling_probability)
        settings = {"noise_multiplier": a.noise_multiplier, "steps": sched.steps,
                    "sampling_probability": sched.sampling_probability, "relation": a.relation,
                    "noise_multiplier_note": NOISE_MULTIPLIER_NOTE}
        if a.epochs is not None:
            settings["epochs"] = a.epochs
        if a.epochs is not None or a.batch_size is not None:
            run = f"; {sched.steps} steps at q={sched.sampling_probability:.6g}"
    else:
        ev = pure_steps_event(a.epsilon, _validate.positive_int("steps", a.steps))
        settings = {"epsilon0": a.epsilon, "steps": int(a.steps)}
    relation = getattr(a, "relation", "add-remove")
    r = epsilon(ev, a.delta, a.method,
                neighboring_relation=NeighboringRelation[_RELATIONS[relation]])
    out = r.to_dict() | settings
    first, *rest = r.summary().split("\n")  # the run's steps end the first line, as in calibrate
    text = "\n".join([first + run, *rest])
    if a.mechanism == "gaussian":
        text += f"\n  - {NOISE_MULTIPLIER_NOTE}"
    emit(out, a.json, text)


def run_calibrate(a: argparse.Namespace) -> None:
    relation = NeighboringRelation[_RELATIONS[a.relation]]
    rel_note = "" if a.relation == "add-remove" else \
        f"; neighbouring relation: {relation_label(relation.name)}"
    if a.batch_size is not None or (a.sampling_probability or 1.0) < 1:
        _check_gaussian_method(a.method, a.sampling_probability)
    if a.mechanism == "steps":
        s = calibrate_steps(noise_multiplier=a.noise_multiplier, target_epsilon=a.target_epsilon,
                            delta=a.delta, sampling_probability=a.sampling_probability,
                            batch_size=a.batch_size, dataset_size=a.dataset_size,
                            method=a.method, neighboring_relation=relation)
        out = {"steps": s.steps, "epochs": s.epochs, "epsilon": s.epsilon, "delta": s.delta,
               "method": s.method, "target_epsilon": s.target_epsilon,
               "noise_multiplier": a.noise_multiplier,
               "sampling_probability": s.sampling_probability, "relation": a.relation,
               "noise_multiplier_note": NOISE_MULTIPLIER_NOTE}
        run = (f"; {s.epochs:.6g} epochs at q={s.sampling_probability:.6g}"
               if s.sampling_probability < 1 else "")
        emit(out, a.json, f"steps = {s.steps} (verified eps <= {s.epsilon:.6g} at "
             f"delta={s.delta:.3g}, {s.method}{rel_note}){run}\n  - {NOISE_MULTIPLIER_NOTE}")
        return
    r = calibrate_noise_multiplier(target_epsilon=a.target_epsilon, delta=a.delta,
                                   steps=a.steps, epochs=a.epochs,
                                   sampling_probability=a.sampling_probability,
                                   batch_size=a.batch_size, dataset_size=a.dataset_size,
                                   method=a.method, neighboring_relation=relation)
    out = {"noise_multiplier": r.noise_multiplier, "epsilon": r.epsilon, "delta": r.delta,
           "method": r.method, "target_epsilon": r.target_epsilon, "steps": r.steps,
           "sampling_probability": r.sampling_probability, "relation": a.relation,
           "noise_multiplier_note": NOISE_MULTIPLIER_NOTE}
    if a.epochs is not None:
        out["epochs"] = a.epochs
    run = (f"; {r.steps} steps at q={r.sampling_probability:.6g}" if a.epochs is not None
           or a.batch_size is not None else "")
    emit(out, a.json, f"noise_multiplier = {r.noise_multiplier:.6g} "
         f"(verified eps <= {r.epsilon:.6g} at delta={r.delta:.3g}, {r.method}{rel_note})"
         f"{run}\n  - {NOISE_MULTIPLIER_NOTE}")


# ------------------------------------------------------------------ privkit midp
def add_midp_parser(sub: Any) -> None:
    """``privkit midp coded``: MI-DP (nats) of one client's SCFL coded upload."""
    mi_sub = subcommands(sub, "midp", "mutual-information DP (nats) of a release; not an epsilon")
    c = mi_sub.add_parser(
        "coded", help="SCFL coded upload G X + sigma N (and G Y + sigma_y N_y)",
        description="MI-DP upper bound (Cuff-Yu, nats) of one client's one-time coded upload. "
        "It covers the coded upload only (SCFL's per-epoch client gradients are unprotected) "
        "and implies only (0, sqrt(2 nats))-DP: it is not an epsilon.")
    c.add_argument("--rows", type=number, required=True, help="c, number of coded rows")
    c.add_argument("--noise-stddev", type=number, required=True,
                   help="sigma, absolute stddev of the feature noise (0: no privacy)")
    c.add_argument("--norm-bound", type=number, required=True,
                   help="rho, L2 bound the feature rows are clipped to (bias column included)")
    c.add_argument("--dim", type=number, required=True, help="d, number of feature columns")
    c.add_argument("--label-dim", type=number, default=0,
                   help="o, label columns uploaded as G Y (+ noise); 0 (default): no labels")
    c.add_argument("--label-noise-stddev", type=number, default=None,
                   help="sigma_y (default: sigma); 0 is the paper's noiseless labels")
    c.add_argument("--label-norm-bound", type=number, default=None,
                   help="rho_y, labels' L2 bound (one-hot: 1; required for continuous labels)")
    c.add_argument("--label-kind", default="one-hot", choices=["one-hot", "continuous"],
                   help="one-hot (categorical, default) or continuous labels")
    c.add_argument("--bits", action="store_true", help="print bits instead of nats (text)")
    add_json(c)


def run_midp(a: argparse.Namespace) -> None:
    from privkit.accountants.midp import CodedDataMiEvent, LabelMode, midp_coded_release

    o = _validate.nonnegative_int("label_dim", a.label_dim)
    categorical = a.label_kind == "one-hot"
    sigma = _validate.nonnegative("noise_stddev", a.noise_stddev)
    if o == 0:
        for name in ("label_noise_stddev", "label_norm_bound"):
            if getattr(a, name) is not None:
                raise InvalidParameterError(name, getattr(a, name), "used with --label-dim >= 1")
        mode, sy, ry = LabelMode.NONE, 0.0, None
    else:
        sy = sigma if a.label_noise_stddev is None else _validate.nonnegative(
            "label_noise_stddev", a.label_noise_stddev)
        mode = LabelMode.NOISY if sy > 0 else LabelMode.PAPER_NOISELESS
        if categorical:
            if a.label_norm_bound not in (None, 1.0):
                raise InvalidParameterError("label_norm_bound", a.label_norm_bound,
                                            "1 (or omitted) for one-hot labels")
            ry = 1.0
        else:
            ry = (None if a.label_norm_bound is None
                  else _validate.positive("label_norm_bound", a.label_norm_bound))
            if ry is None and mode is LabelMode.NOISY:
                raise InvalidParameterError("label_norm_bound", None,
                                            "given for continuous labels with label noise")
    ev = CodedDataMiEvent(
        num_coded_rows=_validate.positive_int("rows", a.rows), stddev=sigma,
        row_l2_bound=_validate.positive("norm_bound", a.norm_bound),
        dim=_validate.positive_int("dim", a.dim), label_mode=mode, label_stddev=sy,
        label_l2_bound=ry, label_dim=o, categorical_labels=categorical and o > 0)
    r = midp_coded_release(ev)
    out = r.to_dict() | {"rows": ev.num_coded_rows, "noise_stddev": sigma,
                         "norm_bound": ev.row_l2_bound, "dim": ev.dim, "label_dim": o,
                         "label_noise_stddev": sy, "label_norm_bound": ry,
                         "label_kind": a.label_kind if o else None}
    value = f"{r.bits:.6g} bits" if a.bits else f"{r.nats:.6g} nats"
    flag = "  [labels fully disclosed]" if r.labels_fully_disclosed else ""
    tv = out["implied_tv_delta"]
    implied = (f"implies only (0, {tv:.3g})-DP" if tv < 1
               else "implies no (epsilon, delta)-DP guarantee (sqrt(2 nats) >= 1)")
    text = (f"MI-DP <= {value} per record  [{r.method}]{flag}\n"
            f"  label mode: {r.label_mode.value}; covers: {r.covers}\n"
            f"  average-case (Cuff-Yu); {implied}; not an epsilon")
    emit(out, a.json, text)
