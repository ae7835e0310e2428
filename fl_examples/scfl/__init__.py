"""SCFL (stochastic coded federated learning) and its baselines, on a simulated timing model.

Sun, Shao, Li, Mao, Zhang, "Stochastic Coded Federated Learning with Convergence and Privacy
Guarantees", ISIT 2022 (arXiv 2201.10092). Linear regression ``f(W) = (1/2)||X W - Y||_F^2``
(one-hot targets for classification data), gradient ``X^T (X W - Y)``.

* Before training every client uploads once ``X~_i = G_i X_i + sigma_i N_i`` and
  ``Y~_i = G_i Y_i (+ sigma_y N_y)`` (:func:`privkit.mechanisms.coded.code_client_data`); the
  server keeps the sum. Each upload's MI-DP is priced by :mod:`privkit.accountants.midp`.
* Epoch r: client i computes ``g_i = (l_i/b_i) X_B^T (X_B W - Y_B)`` on a batch of b_i rows;
  it arrives iff ``t_i = b_i N_MAC/MACR_i + N_i tau_u,i + t_d <= T`` (N_i geometric
  retransmissions, erasure probability p_l,i). The server computes
  ``g_s = (1/b_s) X^_s^T (X^_s W - Y^_s)`` on b_s coded rows and aggregates
  ``g = kappa sum_i 1{arrived} g_i / p_i + (1 - kappa)(g_s + g_o)``, ``g_o = -(sum_i
  sigma_i^2) W``; ``W <- W - eta g``. The epoch lasts T (simulated seconds).
* Output: the average ``(1/R) sum_{r=1}^R W^(r)`` (the paper's; W^(1) is the initial model);
  the last iterate is reported too.

``p_i(T, b) = 1 - p_l^k`` with ``k = floor((T - t_c(b) - t_d)/tau_u)`` when k >= 1, else 0
(derived). Clients with p_i = 0 can never arrive: they are excluded with a warning (the client
part then misses their share). Baselines (:class:`ScflMethod`) differ from SCFL only in the
named respect; all methods share one seed tree (coding, batches, retransmissions).
kappa = 1/2 by default (paper value not available verbatim).

The package: :mod:`~fl_examples.scfl.config` (methods and settings),
:mod:`~fl_examples.scfl.timing` (the straggler timing model), :mod:`~fl_examples.scfl.data`
(the regression data), :mod:`~fl_examples.scfl.gradients` (the gradients and their
aggregation) and :mod:`~fl_examples.scfl.run` (one method's run on the trainer skeleton);
:func:`train` runs a comparison.

Run ``privkit train scfl --dataset digits --clients 20 --coded-rows 500 --noise-stddev 1.0
--algorithms scfl,fl-pma,codedfedl,dp-cfl,cfl-fb --rounds 300 --out DIR``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from fl_examples.core.canaries import check_fits, finish
from fl_examples.core.epsilon_plot import ledger_epsilon_curves, plot_vs_epsilon
from fl_examples.core.report import (
    Column,
    epsilon_section,
    figure_text,
    legend_label,
    midp_section,
    text_table,
    write_report,
)
from fl_examples.scfl.config import BatchSampling, ScflConfig, ScflMethod, _enum
from fl_examples.scfl.data import RegressionData, load_data, synthetic_linreg
from fl_examples.scfl.gradients import (
    aggregate,
    client_gradient,
    dp_client_gradient,
    makeup_term,
    server_gradient,
)
from fl_examples.scfl.run import _setup, run_method
from fl_examples.scfl.timing import TimingModel, arrival_probability
from privkit.accountants.midp import COVERS, implied_tv_delta
from privkit.errors import InvalidParameterError

#: What the run's privacy numbers cover, in the report and under every plot.
PRIVACY_SCOPE = ("Privacy: MI-DP in nats (average-case) of the one-time coded upload only; the "
                 "per-epoch client gradients carry no noise (unprotected). MI-DP is not an "
                 "epsilon: I nats implies at best (0, delta)-DP with delta = sqrt(2 I), and "
                 "from I = 0.5 nats on that delta is 1 or more, which implies nothing.")
#: The same with record-level DP-SGD noise on the client gradients.
PRIVACY_SCOPE_GRADIENT_DP = (
    "Privacy: the per-epoch client gradients are record-level (epsilon, delta)-DP per client "
    "(DP-SGD: per-example clipping, Gaussian noise, Poisson minibatches; gradient_privacy); "
    "the one-time coded upload is priced separately in MI-DP nats, not an epsilon: I nats "
    "implies at best (0, delta)-DP with delta = sqrt(2 I), which implies nothing from "
    "I = 0.5 nats on. The two are not combined into one number.")


def _implied(results: dict[str, Any]) -> str:
    """What the run's largest MI-DP implies, said plainly (nothing, when delta >= 1)."""
    nats = [r["privacy"]["mi_dp_nats_max"] for r in results.values()
            if isinstance(r.get("privacy"), dict) and "mi_dp_nats_max" in r["privacy"]]
    if not nats:
        return ""
    top = max(nats)
    delta = implied_tv_delta(top)
    if delta >= 1:
        return (f" Here the largest is {top:.3g} nats: sqrt(2 x {top:.3g}) = "
                f"{math.sqrt(2 * top):.3g} > 1, so the coded upload has no (epsilon, "
                "delta)-DP guarantee at all.")
    return (f" Here the largest is {top:.3g} nats: at best (0, {delta:.3g})-DP for the coded "
            "upload.")


def _settings(config: dict[str, Any], results: dict[str, Any]) -> str:
    """The key settings every SCFL figure's title names (after the data set and seed)."""
    c = config
    parts = [f"{c['num_clients']} clients", f"{c['rounds']} rounds",
             f"{c['num_coded_rows']} coded rows", f"coding noise stddev {c['stddev']:g}"]
    zs = sorted({r["gradient_privacy"]["noise_multiplier"] for r in results.values()
                 if "gradient_privacy" in r})
    if zs:
        parts.append(f"gradient noise z {', '.join(f'{z:.3g}' for z in zs)}, clip "
                     f"{c['gradient_clip']:g}")
    if c.get("gradient_noise_for_epsilon") is not None:
        parts.append(f"calibrated to epsilon {c['gradient_noise_for_epsilon']:g}")
    return ", ".join(parts)


def _plot_vs_epsilon(out: Path, config: dict[str, Any], results: dict[str, Any],
                     note: str) -> None:
    """``curves_vs_epsilon.png`` with gradient noise: held-out accuracy (held-out loss on a
    regression) against the client gradients' epsilon after each evaluated epoch, replayed
    from each method's ledger (max over clients)."""
    curves = ledger_epsilon_curves(out, results, "iteration")
    if not curves:
        return
    p = epsilon_section(results[next(iter(curves))])
    assert p is not None
    refs = {n: r["history"][-1] for n, r in results.items() if r.get("history")
            and epsilon_section(r) is None and midp_section(r) is None}
    plot_vs_epsilon(out, curves, references=refs,
                    text=figure_text(config, results, _settings(config, results), note=note),
                    labels={n: legend_label(n, results[n]) for n in curves},
                    x_label="client gradients' ε after each evaluation, cumulative (max over "
                            f"clients, δ = {p['delta']:g}; the coded upload is not in it)")


__all__ = ["ScflMethod", "BatchSampling", "ScflConfig", "TimingModel", "RegressionData",
           "load_data", "synthetic_linreg", "client_gradient", "dp_client_gradient",
           "server_gradient", "makeup_term", "aggregate", "arrival_probability", "train",
           "final_table", "time_to_loss", "run_method", "KAPPA_NOTE", "PRIVACY_SCOPE",
           "PRIVACY_SCOPE_GRADIENT_DP"]

KAPPA_NOTE = "kappa = 1/2 (paper value not available verbatim)"


def _methods(names: Any) -> list[ScflMethod]:
    items = names.split(",") if isinstance(names, str) else list(names)
    out = [_enum(ScflMethod, "algorithms", s.strip() if isinstance(s, str) else s)
           for s in items if not isinstance(s, str) or s.strip()]
    if not out:
        raise InvalidParameterError("algorithms", names, "at least one method")
    return list(dict.fromkeys(out))


def train(cfg: ScflConfig, *, algorithms: Any = ("scfl", "fl-pma"), out: str | Path | None = None,
          resume: bool = False) -> dict[str, Any]:
    """Run every method in ``algorithms`` on the same data, coding and timing draws."""
    methods = _methods(algorithms)
    sh = _setup(cfg, methods)
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        out_path.mkdir(parents=True, exist_ok=True)
    # --audit-canaries: the first method whose clients send (noisy) gradients
    audited = next((m for m in methods if m.uses_client_gradients), None) \
        if cfg.audit_canaries else None
    if cfg.audit_canaries and audited is None:
        raise InvalidParameterError("audit_canaries", cfg.audit_canaries, "given only when a "
                                    "method whose clients send gradients runs (not dp-cfl "
                                    "alone)")
    if audited is not None:  # M canaries need M coordinates of W (d x o)
        check_fits(cfg.audit_canaries, int(sh.x_all.shape[1] * sh.y_all.shape[1]))
    results = {m.value: run_method(m, sh, out=out_path, resume=resume, audit=m is audited)
               for m in methods}
    audit = None
    if audited is not None:
        entry = results[audited.value]
        p, i = entry["gradient_privacy"], entry["gradient_privacy"]["canaries"]["client"]
        audit = finish(entry["_canaries"],
                       algorithm=f"{audited.value} (client {sh.data.client_ids[i]})",
                       accounted_epsilon=p["per_client"][i], delta=p["delta"], out=out_path)
    t = sh.timing
    config = dataclasses.asdict(cfg) | {
        "algorithms": [m.value for m in methods],
        "privacy": "coded-mi-dp+gradient-dp" if cfg.gradient_dp else "coded-mi-dp",
        "dataset_description": sh.data.description, "num_clients": len(sh.data.sizes),
        "num_samples": int(sh.data.sizes.sum()), "dim": int(sh.x_all.shape[1]),
        "outputs": int(sh.y_all.shape[1]), "kappa_note": KAPPA_NOTE,
        "eta": sh.eta, "timing": {"n_mac": t.n_mac, "macr": t.macr.tolist(),
                                  "macr_server": t.macr_server, "tau_u": t.tau_u.tolist(),
                                  "erasure": t.erasure.tolist(), "t_down": t.t_down}}
    key = "heldout_loss" if cfg.gradient_dp else "train_loss"  # public data when private
    target = results.get("fl-pma", {}).get("history", [{}])[-1].get(key)
    for entry in results.values():
        entry["time_to_fl_pma_final_loss_s"] = (time_to_loss(entry["history"], target, key)
                                                if target is not None else None)
    if out_path is not None:
        scope = (PRIVACY_SCOPE_GRADIENT_DP if cfg.gradient_dp else PRIVACY_SCOPE) \
            + _implied(results)
        write_report(out_path, config, results, sections={"privacy_scope": scope} | (
            {"audit": audit} if audit is not None else {}), note=scope,
            settings=_settings(config, results))
        _plot_vs_epsilon(out_path, config, results, scope)
    return {"config": config, "algorithms": results} | (
        {"audit": audit} if audit is not None else {})


def time_to_loss(history: list[dict[str, Any]], target: float,
                 key: str = "train_loss") -> float | None:
    """Simulated time of the first evaluation whose loss ``key`` is <= target (None: never)."""
    for h in history:
        if h[key] <= target:
            return float(h["simulated_time_s"])
    return None


_COLUMNS = (Column("method", 14), Column("rounds", 6), Column("train loss", 10, ".5f"),
            Column("test acc", 8), Column("sim time s", 10, ".2f"),
            Column("mean arrivals", 13, ".2f"), Column("t to PMA loss", 13),
            Column("MI-DP nats (mean/max)", 22))
#: With gradient noise (a private run): the held-out metrics, public data.
_PRIVATE_COLUMNS = (Column("method", 14), Column("rounds", 6),
                    Column("heldout loss", 12, ".5f"), Column("heldout acc", 11),
                    Column("sim time s", 10, ".2f"), Column("mean arrivals", 13, ".2f"),
                    Column("t to PMA loss", 13), Column("MI-DP nats (mean/max)", 22))


def final_table(result: dict[str, Any]) -> str:
    """Final loss, accuracy, simulated time and MI-DP of each method."""
    rows = []
    for name, r in result["algorithms"].items():
        f = r["history"][-1]
        arr = np.mean(r["arrivals_per_round"]) if r["arrivals_per_round"] else 0.0
        ttl = r.get("time_to_fl_pma_final_loss_s")
        p = r.get("privacy")
        mi = (f"{p['mi_dp_nats_mean']:.4g}/{p['mi_dp_nats_max']:.4g}" if p else "- (no upload)")
        if p and p["labels_fully_disclosed"]:
            mi += " [labels disclosed]"
        private = "heldout_loss" in f
        loss = f["heldout_loss"] if private else f["train_loss"]
        acc = f.get("heldout_accuracy" if private else "test_accuracy")
        rows.append((name, f["iteration"], loss, "-" if acc is None or acc != acc
                     else f"{acc:.4f}", f["simulated_time_s"], arr,
                     "-" if ttl is None else f"{ttl:.2f}", mi))
    first = next(iter(result["algorithms"].values()))["history"][-1]
    cols = _PRIVATE_COLUMNS if "heldout_loss" in first else _COLUMNS
    lines = text_table(cols, rows)
    dp = {n: r["gradient_privacy"] for n, r in result["algorithms"].items()
          if "gradient_privacy" in r}
    covers = "coded upload only" if dp else COVERS
    nats = [r["privacy"]["mi_dp_nats_max"] for r in result["algorithms"].values()
            if r.get("privacy")]
    tv = math.sqrt(2 * max(nats)) if nats else math.nan
    implied = (f"the largest implies only (0, {tv:.3g})-DP (sqrt(2 nats), Pinsker)" if tv < 1
               else "implies no (epsilon, delta)-DP guarantee here: sqrt(2 nats) >= 1"
               if nats else "nothing uploaded")
    lines.append(f"\nMI-DP: {covers}; {implied}. {KAPPA_NOTE}.")
    if dp:
        lines.append("client gradients, record-level DP-SGD (per client, upper bounds):")
        lines += [f"  {n}: eps mean {p['epsilon_mean']:.4g}, max {p['epsilon_max']:.4g} at "
                  f"delta={p['delta']:g} [{p['method']}], clip {p['l2_clip_norm']:g}, "
                  f"z {p['noise_multiplier']:.4g}" for n, p in dp.items()]
        p0 = next(iter(dp.values()))
        mark = {"simulation": "seeded simulation: the guarantee holds only against someone "
                "who does not know --seed", "proven": "batches and noise from the OS CSPRNG",
                "not proven": "NOT PROVEN"}[p0["guarantee"]]
        lines.append(f"({mark}; not covered by epsilon: "
                     + "; ".join(n["field"] for n in p0["not_covered"]) + ")")
    else:
        lines.append("client gradients: no noise (unprotected).")
    return "\n".join(lines)
