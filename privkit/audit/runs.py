"""An audited run's scores as JSON, and the bounds recomputed from them.

A trainer that plants canaries (:mod:`privkit.audit.canaries`) ends with one in- and one
out-score per canary (one run) or per trial (two runs). :class:`CanaryRun` holds them with
what the bounds need (the mode, the threat model, the delta, the accounted epsilon, the
settings) and saves them as one JSON object (schema :data:`SCHEMA`) in the run's output
directory; :func:`recompute` reads that file back and recomputes every bound that applies
to its mode (:meth:`CanaryRun.audit`), so anyone can check the verdict from the scores alone.

Which bounds apply (:data:`METHODS`):

* ``two-run``: each score is an independent run: Clopper-Pearson and GDP (thresholds
  ``"all"``), and the Gaussian one-run model (the scores of independent runs, Gaussian when
  the run's releases are).
* ``one-run``: many canaries, fair coins, one run: Steinke et al.'s bound (no assumption
  but the coins) and the Gaussian one-run bound (its model stated).
* ``final-model``: cosines with the final model change: Steinke et al.'s bound (valid for
  any score) and the Gaussian one-run bound, plus Andrew et al.'s **estimate**
  (:func:`final_model_estimate`).

Examples:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> run = CanaryRun(in_scores=rng.normal(0.5, 1, 300), out_scores=rng.normal(0, 1, 300),
    ...                 mode="one-run", delta=1e-5, accounted_epsilon=2.0)
    >>> a = run.audit()
    >>> [b.method for b in a.bounds], a.exceeded
    (['one-run', 'gaussian-one-run'], False)
    >>> CanaryRun.from_json(run.to_json()).audit().best.epsilon_lower_bound == (
    ...     a.best.epsilon_lower_bound)
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from privkit import _validate
from privkit.audit._score_results import _plain, _scores
from privkit.audit.scores import (
    DEFAULT_CONFIDENCE,
    EpsilonEstimate,
    EpsilonLowerBound,
    clopper_pearson_bound,
    gaussian_bound,
    gaussian_pair_epsilon,
    gdp_bound,
    one_run_bound,
)
from privkit.errors import InvalidParameterError

__all__ = ["SCHEMA", "MODES", "THREAT_MODELS", "METHODS", "CanaryRun", "RunAudit",
           "recompute", "final_model_estimate", "SCORES_FILE"]

SCHEMA = "privkit.audit-run/1"
"""The ``schema`` field of a saved :class:`CanaryRun`."""

SCORES_FILE = "audit_scores.json"
"""The file name a trainer saves its scores under in its output directory."""

MODES = ("one-run", "two-run", "final-model")
THREAT_MODELS = ("white-box", "final-model")
METHODS: Mapping[str, tuple[str, ...]] = {
    "two-run": ("clopper-pearson", "gdp", "gaussian-one-run"),
    "one-run": ("one-run", "gaussian-one-run"),
    "final-model": ("one-run", "gaussian-one-run"),
}
"""The lower bounds :meth:`CanaryRun.audit` computes for each mode."""


#: How :meth:`RunAudit.summary` names each method.
_METHOD_NAMES = {"one-run": "Steinke et al. one-run", "gaussian-one-run": "gaussian one-run",
                 "clopper-pearson": "Clopper-Pearson", "gdp": "GDP"}


def final_model_estimate(in_scores: Any, out_scores: Any, *, delta: float) -> EpsilonEstimate:
    """Andrew et al.'s (ICLR 2024) one-shot **estimate**: a Gaussian fitted to the in-scores
    (cosines of the inserted canaries with the final model change) and one to the
    out-scores, and the epsilon at ``delta`` between the two (:func:`gaussian_pair_epsilon`).
    It is not a bound: no confidence statement covers the fit.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> e = final_model_estimate(rng.normal(0.1, 0.05, 500), rng.normal(0, 0.05, 500),
        ...                          delta=1e-5)
        >>> e.method, e.note
        ('andrew-et-al-final-model', 'an estimate, not a bound')
    """
    in_s, out_s = _scores("in_scores", in_scores, 2), _scores("out_scores", out_scores, 2)
    d = _validate.delta("delta", delta)
    m1, s1 = float(in_s.mean()), float(in_s.std(ddof=1))
    m0, s0 = float(out_s.mean()), float(out_s.std(ddof=1))
    if not (s1 > 0 and s0 > 0):
        raise InvalidParameterError("in_scores", "scores without spread",
                                    "scores whose standard deviation is > 0 on both sides")
    eps = gaussian_pair_epsilon(m1, s1, m0, s0, d)
    return EpsilonEstimate(eps, "andrew-et-al-final-model", d,
                           ("in- and out-cosines are Gaussian; the fitted means and standard "
                            "deviations are taken as the truth",),
                           {"mean_in": m1, "sd_in": s1, "mean_out": m0, "sd_out": s0,
                            "n_in": int(in_s.size), "n_out": int(out_s.size)})


@dataclasses.dataclass(frozen=True)
class RunAudit:
    """The bounds and estimates recomputed from a :class:`CanaryRun`.

    Attributes:
        bounds: one :class:`EpsilonLowerBound` per applicable method, each at the run's
            delta and at ``confidence`` on its own.
        estimates: the labelled estimates (final-model mode).
        accounted_epsilon: the run's printed (upper-bound) epsilon, or None.
        confidence: each bound's confidence.
    """

    bounds: tuple[EpsilonLowerBound, ...]
    estimates: tuple[EpsilonEstimate, ...]
    accounted_epsilon: float | None
    confidence: float

    @property
    def best(self) -> EpsilonLowerBound:
        """The largest lower bound (several bounds each at ``confidence``: the largest holds
        with at least ``1 - len(bounds) (1 - confidence)``)."""
        return max(self.bounds, key=lambda b: b.epsilon_lower_bound)

    @property
    def joint_confidence(self) -> float:
        """The confidence with which every bound holds at once (a union bound)."""
        return max(0.0, 1.0 - len(self.bounds) * (1.0 - self.confidence))

    @property
    def exceeded(self) -> bool:
        """Whether some lower bound is above the accounted epsilon (False without one)."""
        return self.accounted_epsilon is not None and any(
            b.exceeds(self.accounted_epsilon) for b in self.bounds)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"accounted_epsilon": self.accounted_epsilon, "confidence": self.confidence,
                "joint_confidence": self.joint_confidence, "exceeded": self.exceeded,
                "best": self.best.method,
                "bounds": [b.to_dict() for b in self.bounds],
                "estimates": [e.to_dict() for e in self.estimates]}

    def summary(self) -> str:
        """One line: the largest lower bound beside the accounted epsilon (what a trainer run
        with ``--audit-canaries`` and ``privkit audit run`` print).

        Examples:
            >>> b = EpsilonLowerBound(1.234, "gaussian-one-run", 0.95, 1e-5, (), {})
            >>> RunAudit((b,), (), 4.0, 0.95).summary()
            'audit: empirical epsilon >= 1.23 (gaussian one-run, 95%) beside the accounted 4.00'
        """
        b = self.best
        name = _METHOD_NAMES.get(b.method, b.method)
        head = f"audit: empirical epsilon >= {b.epsilon_lower_bound:.2f} ({name}, " \
            f"{b.confidence:.0%})"
        if self.accounted_epsilon is None:
            return head + " (no accounted epsilon given)"
        flag = ": ABOVE IT, the run leaks more than its accounting says" if self.exceeded \
            else ""
        return f"{head} beside the accounted {self.accounted_epsilon:.2f}{flag}"

    def lines(self) -> list[str]:
        """A few lines for a person: each bound beside the accounted epsilon."""
        acc = "none given" if self.accounted_epsilon is None else f"{self.accounted_epsilon:.4g}"
        out = [f"accounted epsilon (upper bound): {acc}"]
        for b in self.bounds:
            flag = "  ABOVE THE ACCOUNTED EPSILON" if self.accounted_epsilon is not None \
                and b.exceeds(self.accounted_epsilon) else ""
            out.append(f"  {b.method:<18} lower bound {b.epsilon_lower_bound:.4g} at delta "
                       f"{b.delta:g}, {b.confidence:.0%} confidence{flag}")
        for e in self.estimates:
            out.append(f"  {e.method:<18} estimate {e.epsilon_estimate:.4g} ({e.note})")
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class CanaryRun:
    """The scores of an audited run and what is needed to recompute its bounds.

    Attributes:
        in_scores: scores of the inserted canaries (or in-runs).
        out_scores: scores of the canaries left out (or out-runs).
        mode: ``one-run``, ``two-run`` or ``final-model`` (:data:`MODES`).
        delta: the delta of the bounds (the accounted epsilon's).
        accounted_epsilon: the run's accounted epsilon at ``delta`` (with the canaries
            present: they were extra contributions), or None.
        threat_model: ``white-box`` (every release scored) or ``final-model``; default from
            the mode.
        statistic: how a score was made (free text, e.g. ``"sum"``, ``"llr"``,
            ``"cosine"``).
        settings: JSON-ready facts of the run (noise multiplier, clip norm, sampling
            probability, releases, the canaries' m, kind, norm and seed, ...).
    """

    in_scores: Any
    out_scores: Any
    mode: str
    delta: float
    accounted_epsilon: float | None = None
    threat_model: str | None = None
    statistic: str = ""
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_scores", _scores("in_scores", self.in_scores, 0))
        object.__setattr__(self, "out_scores", _scores("out_scores", self.out_scores, 0))
        if self.mode not in MODES:
            raise InvalidParameterError("mode", self.mode, " or ".join(MODES))
        _validate.delta("delta", self.delta)
        if self.accounted_epsilon is not None:
            _validate.nonnegative("accounted_epsilon", self.accounted_epsilon)
        tm = self.threat_model or ("final-model" if self.mode == "final-model" else "white-box")
        if tm not in THREAT_MODELS:
            raise InvalidParameterError("threat_model", self.threat_model,
                                        " or ".join(THREAT_MODELS))
        object.__setattr__(self, "threat_model", tm)
        if not isinstance(self.settings, Mapping):
            raise InvalidParameterError("settings", self.settings, "a mapping")

    @property
    def confidence(self) -> float:
        """The confidence the run's own audit used: ``settings["confidence"]`` where it saved
        one, else :data:`DEFAULT_CONFIDENCE`."""
        return float(self.settings.get("confidence", DEFAULT_CONFIDENCE))

    def audit(self, confidence: float | None = None) -> RunAudit:
        """Every bound of :data:`METHODS` for this run's mode, each at ``confidence`` (None:
        :attr:`confidence`)."""
        confidence = self.confidence if confidence is None else confidence
        c = _validate.real("confidence", confidence)
        if not 0 < c < 1 or math.isnan(c):
            raise InvalidParameterError("confidence", confidence, "in the open interval (0, 1)")
        d = float(self.delta)
        bounds: list[EpsilonLowerBound] = []
        estimates: list[EpsilonEstimate] = []
        ins, outs = self.in_scores, self.out_scores
        for method in METHODS[self.mode]:
            if method == "clopper-pearson":
                bounds.append(clopper_pearson_bound(ins, outs, delta=d, confidence=confidence))
            elif method == "gdp":
                bounds.append(gdp_bound(ins, outs, delta=d, confidence=confidence))
            elif method == "one-run":
                bounds.append(one_run_bound(ins, outs, delta=d, confidence=confidence))
            else:
                bounds.append(gaussian_bound(ins, outs, delta=d, confidence=confidence))
        if self.mode == "final-model":
            estimates.append(final_model_estimate(ins, outs, delta=d))
        return RunAudit(tuple(bounds), tuple(estimates), self.accounted_epsilon,
                        float(confidence))

    def to_json(self) -> dict[str, Any]:
        """The JSON object of :data:`SCHEMA` (scores as lists of floats)."""
        return {"schema": SCHEMA, "mode": self.mode, "threat_model": self.threat_model,
                "delta": self.delta, "accounted_epsilon": self.accounted_epsilon,
                "statistic": self.statistic, "settings": _plain(self.settings),
                "in_scores": [float(x) for x in self.in_scores],
                "out_scores": [float(x) for x in self.out_scores]}

    @classmethod
    def from_json(cls, obj: Any) -> CanaryRun:
        """The run a :meth:`to_json` object describes (refused, naming the field, if it is
        not one)."""
        if not isinstance(obj, Mapping):
            raise InvalidParameterError("audit scores", type(obj).__name__, "a JSON object")
        if obj.get("schema") != SCHEMA:
            raise InvalidParameterError("schema", obj.get("schema"), repr(SCHEMA))
        for key in ("mode", "delta", "in_scores", "out_scores"):
            if key not in obj:
                raise InvalidParameterError(key, None, "present in the audit scores")
        acc = obj.get("accounted_epsilon")
        return cls(in_scores=obj["in_scores"], out_scores=obj["out_scores"], mode=obj["mode"],
                   delta=obj["delta"], accounted_epsilon=acc,
                   threat_model=obj.get("threat_model"), statistic=obj.get("statistic", ""),
                   settings=obj.get("settings") or {})

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON object to ``path`` (a directory: :data:`SCORES_FILE` in it),
        atomically (a temporary file renamed); returns the file's path."""
        p = Path(path)
        if p.is_dir():
            p = p / SCORES_FILE
        tmp = p.with_name(p.name + ".tmp")
        text = json.dumps(self.to_json(), indent=1, allow_nan=False)
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CanaryRun:
        """Read a saved run (``path`` a file, or a directory holding :data:`SCORES_FILE`)."""
        p = Path(path)
        if p.is_dir():
            p = p / SCORES_FILE
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InvalidParameterError("path", str(p), "an existing audit scores file "
                                        f"({SCORES_FILE})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidParameterError("path", str(p), f"a JSON file ({exc})") from None
        return cls.from_json(obj)


def recompute(path: str | os.PathLike[str], confidence: float | None = None) -> RunAudit:
    """The bounds of a saved run, recomputed from its scores (what ``privkit audit run OUT``
    prints), at ``confidence`` (None: the run's own, ``settings["confidence"]`` where the run
    saved one, e.g. a trainer's ``--audit-canaries``, else :data:`DEFAULT_CONFIDENCE`).

    Examples:
        >>> import tempfile, numpy as np
        >>> d = tempfile.mkdtemp()
        >>> rng = np.random.default_rng(0)
        >>> _ = CanaryRun(rng.normal(1, 1, 500), rng.normal(0, 1, 500), "two-run",
        ...               1e-5, accounted_epsilon=4.4).save(d)
        >>> a = recompute(d)
        >>> [round(b.epsilon_lower_bound, 2) for b in a.bounds], a.exceeded
        ([0.94, 2.69, 4.15], False)
    """
    run = CanaryRun.load(path)
    return run.audit(run.confidence if confidence is None else confidence)
