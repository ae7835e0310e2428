"""The one-run lower bound of Steinke, Nasr & Jagielski (NeurIPS 2023), with abstention.

m canaries each included by a fair coin in **one** run; guesses on the top and bottom
scores; the exact tail of their Theorem (:func:`one_run_p_value`) and the largest epsilon it
rejects (:func:`one_run_bound`). Apart from the threshold tests of
:mod:`privkit.audit.scores` (which exports the public names) because its statistics are its
own: coins and guess counts instead of rates at a threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from privkit import _validate
from privkit._lazy import LazyModule
from privkit.audit._score_results import (
    DEFAULT_CONFIDENCE,
    EpsilonLowerBound,
    _confidence,
    _delta,
    _scores,
)
from privkit.errors import InvalidParameterError, NumericalError

special = LazyModule("scipy.special")

__all__ = ["one_run_p_value", "one_run_bound", "default_guesses"]

_COINS = ("each canary was included independently with probability 1/2 (a fair coin), "
          "secret from the score function")


def one_run_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The tail of Steinke, Nasr & Jagielski's one-run Theorem.

    With m canaries each included by a fair coin and a run that is (epsilon, delta)-DP with
    respect to each canary, the probability that ``guesses`` guesses contain at least
    ``correct`` right ones is at most ``f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) -
    f(v)) / i`` with ``v = correct`` and ``f(u) = P[Binomial(guesses, e^eps / (1 + e^eps))
    >= u]`` (``f(v)`` alone for delta = 0). Returned clipped to 1.

    Examples:
        >>> round(one_run_p_value(1000, 100, 80, 1.0, 0.0), 6)
        0.071556
    """
    r = _validate.nonnegative_int("guesses", guesses)
    v = _validate.nonnegative_int("correct", correct)
    n = _validate.positive_int("m", m)
    if not v <= r <= n:
        raise InvalidParameterError("correct", v, f"<= guesses ({r}) <= m ({n})")
    e = _validate.nonnegative("epsilon", epsilon)
    d = _delta(delta, zero=True)
    return _p_value(n, r, v, e, d)


def _binom_sf(k: Any, n: int, p: float) -> np.ndarray:
    """``P[Binomial(n, p) > k]`` for integer ``k`` (arrays too): ``scipy.special.bdtrc``,
    1 below 0 and 0 from n on (what ``scipy.stats.binom.sf`` gives, to ~1e-11 relative,
    without importing scipy.stats: a trainer's audit computes its bounds at the end of a
    run, and that import alone can cost a short run more than its canaries do)."""
    kk = np.asarray(k, dtype=np.float64)
    inside = np.clip(kk, 0.0, max(n - 1, 0))
    return np.where(kk < 0, 1.0, np.where(kk >= n, 0.0, special.bdtrc(inside, n, p)))


def _p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    q = float(special.expit(eps))
    beta = float(_binom_sf(v - 1, r, q))
    if delta == 0.0 or v == 0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    gaps = (_binom_sf(v - i - 1, r, q) - beta) / i
    return min(beta + 2.0 * m * delta * float(np.max(gaps)), 1.0)


def _largest_rejected(m: int, r: int, v: int, delta: float, level: float) -> float:
    """sup{eps : p(eps) <= level}; p increases with eps when 2 m delta < 1."""
    if r == 0 or _p_value(m, r, v, 0.0, delta) > level:
        return 0.0
    lo, hi = 0.0, 1.0
    while _p_value(m, r, v, hi, delta) <= level:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            raise NumericalError("one_run_bound: the p-value stays below the level for every "
                                 "epsilon (all guesses right with too many guesses?)")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _p_value(m, r, v, mid, delta) <= level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return lo  # p(lo) <= level was checked: the conservative end


def default_guesses(m: int) -> tuple[tuple[int, int], ...]:
    """The (k_plus, k_minus) guess counts :func:`one_run_bound` tries by default: the top
    1, 2, 5, 10, 20 and 50% of the m scores guessed in, alone or with as many bottom scores
    guessed out (12 hypotheses, fixed before the scores are seen; duplicates removed).

    Examples:
        >>> default_guesses(100)[:3]
        ((1, 0), (1, 1), (2, 0))
    """
    n = _validate.positive_int("m", m)
    out: list[tuple[int, int]] = []
    for frac in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5):
        k = max(1, int(round(frac * n)))
        for g in ((k, 0), (k, k)):
            if g[0] + g[1] <= n and g not in out:
                out.append(g)
    return tuple(out)


def one_run_bound(in_scores: Any, out_scores: Any, *, delta: float = 0.0,
                  confidence: float = DEFAULT_CONFIDENCE,
                  guesses: Sequence[tuple[int, int]] | None = None) -> EpsilonLowerBound:
    """Steinke, Nasr & Jagielski's one-run lower bound (NeurIPS 2023), with abstention.

    The ``m = n_in + n_out`` canaries were each included by a fair coin in **one** run. For a
    guess rule ``(k_plus, k_minus)`` fixed in advance, the ``k_plus`` highest scores are
    guessed in, the ``k_minus`` lowest out, the rest abstain; ``v`` of the ``r = k_plus +
    k_minus`` guesses are right. The bound is the largest epsilon whose tail
    (:func:`one_run_p_value`) is at most ``(1 - confidence) / len(guesses)`` (a union over
    the rules), found by bisection (the tail increases with epsilon when ``2 m delta < 1``,
    required). Ties among scores are broken by a fixed random order, never by the coins.

    Args:
        in_scores: the scores of the canaries whose coin said in.
        out_scores: the scores of those whose coin said out.
        delta: in [0, 1/(2m)).
        confidence: in (0, 1).
        guesses: the rules to try; default :func:`default_guesses` of m.

    Returns:
        An :class:`EpsilonLowerBound` (method ``one-run``); its counts give the winning rule.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(3)
        >>> b = one_run_bound(rng.normal(4, 1, 500), rng.normal(0, 1, 500), delta=1e-5)
        >>> round(b.epsilon_lower_bound, 3), b.counts["guesses"], b.counts["correct"]
        (4.163, 400, 400)
    """
    in_s, out_s = _scores("in_scores", in_scores, 0), _scores("out_scores", out_scores, 0)
    m = in_s.size + out_s.size
    if m == 0:
        raise InvalidParameterError("in_scores", "no scores", "at least one canary in all")
    d = _delta(delta, zero=True)
    if not 2 * m * d < 1:
        raise InvalidParameterError("delta", delta, f"below 1/(2m) = {1 / (2 * m):.3g} (with "
                                    "more the one-run tail says nothing)")
    c = _confidence(confidence)
    rules = default_guesses(m) if guesses is None else tuple(guesses)
    if not rules:
        raise InvalidParameterError("guesses", guesses, "at least one (k_plus, k_minus)")
    checked = []
    for g in rules:
        try:
            kp, km = (_validate.nonnegative_int("guesses", x) for x in g)
        except (TypeError, ValueError):
            raise InvalidParameterError("guesses", g, "pairs (k_plus, k_minus)") from None
        if kp + km > m or kp + km == 0:
            raise InvalidParameterError("guesses", g, f"pairs with 1 <= k_plus + k_minus <= {m}")
        checked.append((kp, km))
    scores = np.concatenate([in_s, out_s])
    label = np.concatenate([np.ones(in_s.size, bool), np.zeros(out_s.size, bool)])
    # descending score; ties broken by a fixed random permutation, never by the coins (the
    # in-scores come first in ``scores``, so breaking ties by position would favour them)
    order = np.lexsort((np.random.default_rng(0).permutation(m), -scores))
    level = (1.0 - c) / len(checked)
    best = (-1.0, checked[0], 0, 0)
    for kp, km in checked:
        right = int(np.count_nonzero(label[order[:kp]]))
        right += int(np.count_nonzero(~label[order[m - km:]])) if km else 0
        if level < 0.5 and best[0] >= 0 and right <= (kp + km) * float(special.expit(best[0])):
            # at most the Binomial's mean right: its tail at the best epsilon so far is
            # >= 1/2 > level, and the tail increases with epsilon, so it cannot do better
            continue
        eps = _largest_rejected(m, kp + km, right, d, level)
        if eps > best[0]:
            best = (eps, (kp, km), kp + km, right)
    eps, (kp, km), r, v = best
    counts = {"m": m, "n_in": int(in_s.size), "n_out": int(out_s.size), "k_plus": kp,
              "k_minus": km, "guesses": r, "correct": v, "rules_tried": len(checked),
              "level": level}
    return EpsilonLowerBound(max(0.0, eps), "one-run", c, d, (_COINS,), counts)
