"""Private training support shared by the synchronous trainers (public privkit API only).

A :class:`PrivacyPlan` turns the run's privacy settings into one privkit mechanism per client
(output perturbation: clip + Gaussian noise of the uploaded model; objective perturbation: a
linear noise term in the local objective), charges every participating client on a privkit
:class:`~privkit.ledger.Ledger` *before* any noise is drawn, and builds the report's
``privacy`` section. Server-only steps (Upcycled-FL's even iterations) never reach it: they
are post-processing of private outputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import privkit
from privkit import _validate
from privkit.errors import BudgetExceededError, InvalidParameterError
from privkit.ledger import Ledger
from privkit.mechanisms import perturbation as _pert

__all__ = ["PRIVACY_KINDS", "SENSITIVITIES", "PrivacyPlan", "calibrate", "BudgetStop",
           "logreg_lipschitz", "logreg_smoothness", "clip_features", "smallest_batch"]

PRIVACY_KINDS = ("none", "output", "objective", "client", "record")
#: Output perturbation's sensitivities (:data:`privkit.mechanisms.perturbation.SENSITIVITIES`).
SENSITIVITIES = _pert.SENSITIVITIES


def logreg_lipschitz(feature_norm: float) -> float:
    """u1 for multinomial logistic regression on features of L2 norm <= R (a bias column):
    the per-example gradient (p - e_y) (x, 1)^T has Frobenius norm <= sqrt(2) sqrt(R^2 + 1)."""
    return math.sqrt(2.0 * (feature_norm * feature_norm + 1.0))


def logreg_smoothness(feature_norm: float) -> float:
    """beta, the per-example loss's smoothness on such features: the softmax cross-entropy
    Hessian in the logits is <= 1/2, so beta <= (R^2 + 1) / 2."""
    return 0.5 * (feature_norm * feature_norm + 1.0)


#: The smallest minibatch local SGD forms (:func:`privkit.mechanisms.perturbation.smallest_batch`).
smallest_batch = _pert.smallest_batch


def clip_features(ds: Any, feature_norm: float) -> Any:
    """``ds`` with every feature row (train and test) clipped to L2 norm <= ``feature_norm``:
    the public bound that makes the strongly-convex sensitivity's u1 hold for any record."""
    import dataclasses

    r = _validate.positive("feature_norm", feature_norm)

    def clip(x: np.ndarray) -> np.ndarray:
        x64 = x.astype(np.float64)
        norms = np.linalg.norm(x64, axis=1, keepdims=True)
        out = (x64 * np.minimum(1.0, r / np.maximum(norms, 1e-300))).astype(x.dtype)
        # rounding to the stored dtype must not leave a row above the bound: shrink it by a
        # few units in the last place of that dtype until its norm (in float64) is <= R
        shrink = 1.0 - 4.0 * float(np.finfo(x.dtype).eps)
        for _ in range(64):
            over = np.linalg.norm(out.astype(np.float64), axis=1) > r
            if not over.any():
                return out
            out[over] = (out[over].astype(np.float64) * shrink).astype(x.dtype)
        raise AssertionError("feature clipping did not converge")

    desc = dict(ds.description) | {"feature_norm_clip": r}
    held = {} if ds.x_heldout is None else {"x_heldout": clip(ds.x_heldout)}
    return dataclasses.replace(ds, x_train=tuple(clip(x) for x in ds.x_train),
                               x_test=tuple(clip(x) for x in ds.x_test), description=desc,
                               **held)


class BudgetStop(Exception):
    """A client would exceed the budget: the run stops before drawing that round's noise."""


@dataclass(frozen=True)
class PrivacyPlan:
    """Per-client mechanisms for one algorithm's run.

    Attributes:
        kind: ``output`` or ``objective``.
        sizes: |D_i| per client (training records).
        l2_clip_norm, stddev, sensitivity: output perturbation (stddev is the paper's sigma).
        alpha: objective perturbation rate; lipschitz/smoothness/rank its Thm C.2 constants.
        proximal_mu: the local objective's mu (objective perturbation needs mu > 0).
        lipschitz_model: u1 of the per-example loss for ``strongly-convex`` sensitivity (the
            trainer derives it from the public feature clip, :func:`logreg_lipschitz`).
        batch_size: the local minibatch size (``strongly-convex`` with minibatch SGD: the
            bound uses each client's smallest minibatch, :func:`smallest_batch`).
        allow_unproven: run objective perturbation outside Thm C.2, its epsilon marked.
        glm: the model is a generalised linear model (logistic regression).
    """

    kind: str
    sizes: tuple[int, ...]
    l2_clip_norm: float = 10.0
    stddev: float = 1.0
    sensitivity: str = "replace-one"
    alpha: float = 20.0
    proximal_mu: float = 0.1
    lipschitz: float = 1.0
    smoothness: float = 0.25
    rank: int = 2
    lipschitz_model: float | None = None
    batch_size: int = 32
    momentum: float = 0.5
    allow_unproven: bool = False
    glm: bool = True

    def __post_init__(self) -> None:
        _pert.check_perturbation(self.kind, sensitivity=self.sensitivity,
                                 lipschitz_model=self.lipschitz_model, momentum=self.momentum,
                                 glm=self.glm, allow_unproven=self.allow_unproven)
        self.mechanism(0)  # validate now

    def mechanism(self, client: int) -> Any:
        """The privkit mechanism of ``client`` (its |D_i| enters the sensitivity or epsilon)."""
        return self._mechanisms[client]

    @functools.cached_property
    def _mechanisms(self) -> tuple[Any, ...]:
        # Built once per plan: rounds reuse them (charging and releasing).
        return tuple(self._build(int(n)) for n in self.sizes)

    def _build(self, n: int) -> Any:
        return _pert.perturbation_mechanism(
            self.kind, n, l2_clip_norm=self.l2_clip_norm, stddev=self.stddev,
            sensitivity=self.sensitivity, alpha=self.alpha, proximal_mu=self.proximal_mu,
            lipschitz=self.lipschitz, smoothness=self.smoothness, rank=self.rank,
            lipschitz_model=self.lipschitz_model, batch_size=self.batch_size,
            momentum=self.momentum, allow_unproven=self.allow_unproven, glm=self.glm)

    @property
    def neighboring_relation(self) -> Any:
        """The relation the mechanisms' sensitivities are for, which the ledger prices under:
        output perturbation's own (replace-one, or add/remove for ``paper``); add/remove for
        objective perturbation (a pure-DP guarantee stated for one record's presence)."""
        if self.kind == "output":
            return self.mechanism(0).neighboring_relation
        return privkit.NeighboringRelation.ADD_OR_REMOVE_ONE

    def chargeable(self, client: int) -> Any:
        """What the ledger is charged for one release of ``client``: the output-perturbation
        mechanism itself (the ledger then refuses it under a relation its sensitivity is not
        for), or objective perturbation's event."""
        mech = self.mechanism(client)
        return mech if self.kind == "output" else mech.event()

    @property
    def proven(self) -> bool:
        """Whether every assumption behind the reported epsilon is enforced by the code."""
        return self.kind == "output" and self.sensitivity != "paper"

    @property
    def not_proven_because(self) -> str | None:
        if self.kind == "objective":
            return "inexact (SGD) local solver" + ("" if self.glm else " and a non-GLM model")
        if self.sensitivity == "paper":
            return ("Sensitivity.PAPER: tau/|D_i| assumes the clipped model is an average of "
                    "per-example terms of norm <= tau, which a model trained by SGD is not")
        return None

    def describe(self) -> dict[str, Any]:
        if self.kind == "output":
            out = {"mechanism": "gaussian_output_perturbation",
                   "l2_clip_norm": self.l2_clip_norm, "stddev": self.stddev,
                   "sensitivity": self.sensitivity,
                   "sensitivity_formula": {"replace-one": "2*tau", "paper": "tau/|D_i|",
                                           "strongly-convex": "min(2 tau, 2 u1/(b_min mu))"}[
                                               self.sensitivity]}
            if self.sensitivity == "strongly-convex":
                out |= {"lipschitz": self.lipschitz_model, "smallest_batch_per_client": [
                    smallest_batch(int(n), self.batch_size) for n in self.sizes]}
            if self.not_proven_because:
                out["not_proven_because"] = self.not_proven_because
            return out
        return {"mechanism": "objective_perturbation", "alpha": self.alpha,
                "lipschitz": self.lipschitz, "smoothness": self.smoothness, "rank": self.rank,
                "proximal_mu": self.proximal_mu, "not_proven_because": self.not_proven_because}

    # -- charging ----------------------------------------------------------------------------
    def charge(self, ledger: Ledger, clients: Sequence[int], *, round_: int, run_id: str) -> int:
        """Charge one release to each client (all or nothing); returns the receipt's seq.

        Raises :class:`BudgetStop` (nothing charged) if any client would exceed the budget.
        """
        events: dict[Any, list[str]] = {}
        for c in clients:
            events.setdefault(self.chargeable(int(c)), []).append(str(c))
        if not events:
            return -1
        try:  # one all-or-nothing write (one fsync) for the whole round
            return ledger.spend_many([(ids, ev) for ev, ids in events.items()],
                                     label="odd-round release", round=round_,
                                     run_id=run_id).seq
        except BudgetExceededError as exc:
            raise BudgetStop(f"client(s) would exceed the budget in data round {round_}: "
                             f"{exc}") from None

    def report(self, ledger: Ledger, num_clients: int) -> dict[str, Any]:
        """The report's ``privacy`` section (per-client epsilons replayed from the ledger)."""
        eps = ledger.epsilons([str(i) for i in range(num_clients)])
        arr = np.array([eps[str(i)] for i in range(num_clients)])
        rep = ledger.report([str(i) for i in range(num_clients)])
        top = int(np.argmax(arr))
        comp = ledger.composition(str(top))
        method = privkit.epsilon(privkit.ComposedDpEvent(
            [privkit.SelfComposedDpEvent(a, n) for a, n in comp.atoms]), rep.delta,
            neighboring_relation=self.neighboring_relation).method \
            if comp.atoms else rep.method.value
        out = {"delta": rep.delta, "epsilon_mean": float(arr.mean()),
               "epsilon_max": float(arr.max()), "method": method,
               "proven": self.proven, "per_client": arr.tolist(),
               "charged_rounds": _charged_counts(ledger, num_clients)} | self.describe()
        if self.kind == "output" and self.sensitivity == "paper":
            # The paper's own number (Thm C.1 closed form) beside the exact one.
            out["epsilon_mean_paper_formula"] = float(np.mean(_moments(self, out["charged_rounds"],
                                                                      rep.delta)))
        if self.kind == "objective":
            out["epsilon_mean_basic_composition"] = float(np.mean(
                [n * self.mechanism(i).step_epsilon
                 for i, n in enumerate(out["charged_rounds"])]))
        return out


def _charged_counts(ledger: Ledger, num_clients: int) -> list[int]:
    """Releases charged per client, replayed from the ledger."""
    return [int(sum(n for _, n in ledger.composition(str(i)).atoms)) for i in range(num_clients)]


def _moments(plan: PrivacyPlan, counts: Sequence[int], delta: float) -> list[float]:
    out = []
    for i, n in enumerate(counts):
        if n == 0:
            out.append(0.0)
            continue
        ev = privkit.SelfComposedDpEvent(plan.mechanism(i).event(), n)
        out.append(privkit.epsilon(ev, delta, "moments",
                                   neighboring_relation=plan.neighboring_relation).epsilon)
    return out


def calibrate(make_plan: Callable[[float], PrivacyPlan], counts: Sequence[int], *, target: float,
              delta: float, statistic: str, larger_is_more_private: bool) -> tuple[float, float]:
    """Noise parameter x so that the run's mean (or max) epsilon is <= ``target``, tight.

    ``counts`` are each client's planned releases (known in advance: client sampling comes from
    the seed tree). Bisection on log x; the returned x has been evaluated, with the same
    accountant, at <= target.
    """
    if statistic not in ("mean", "max"):
        raise InvalidParameterError("noise_target", statistic, "mean or max")
    target = _validate.positive("noise_for_epsilon", target)

    def eps_of(x: float) -> float:
        plan = make_plan(x)
        evs = [privkit.SelfComposedDpEvent(plan.mechanism(i).event(), int(n))
               for i, n in enumerate(counts) if n > 0]
        if not evs:
            return 0.0
        e = privkit.epsilon_batch(evs, delta, neighboring_relation=plan.neighboring_relation)
        e = np.concatenate([e, np.zeros(sum(1 for n in counts if n == 0))])
        return float(e.mean() if statistic == "mean" else e.max())

    # safe = meets the target; grow/shrink geometrically to a bracket, then bisect
    def safe(x: float) -> bool:
        return eps_of(x) <= target

    x = 1.0
    lo = hi = x
    if safe(x):
        while safe(lo):
            hi, lo = lo, (lo / 2 if larger_is_more_private else lo * 2)
            if not (1e-12 < lo < 1e12):
                return hi, eps_of(hi)
    else:
        while not safe(hi):
            lo, hi = hi, (hi * 2 if larger_is_more_private else hi / 2)
            if not (1e-12 < hi < 1e12):
                raise InvalidParameterError("noise_for_epsilon", target, "reachable")
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if safe(mid):
            hi = mid
        else:
            lo = mid
        if abs(math.log(hi / lo)) < 1e-6:
            break
    return hi, eps_of(hi)

