"""Renyi-DP of DP-REC messages, composition, and client sampling with replacement.

**One message** (:class:`RecDpEvent`). In units sigma = 1 a client sends, per group, K
candidates ``z_k ~ N(0, I)`` (public through the seed) and an index drawn from
``softmax_k <z_k, u>`` with ``||u|| <= c = C / sigma``. The paper's privacy theorem is not
available, so privkit prices a message with the derived and numerically checked bound of its
spec (Theorem R, "dp_rec" sections 5.4-5.6), plain RDP with no failure probability:

* ``REPLACE_ONE`` (any two updates of the C-ball), at p* = (2 alpha - 1)/(alpha - 1) and on a
  geometric p grid around it (the minimum is kept)::

      eps(alpha) <= (1/beta) { (A + B + 2 alpha beta) c^2 / 2 + (1/p) log m+_{K-1}(beta p, c)
                               + (1/q) log m-_{K-1}(alpha q, c) },   beta = alpha - 1,
      A = max(alpha beta, alpha^2/(p-1)), B = max(alpha beta, beta^2 (p-1)), q = p/(p-1);

  at p* this is ``2 alpha c^2 + log m+(2a-1)/(2a-1) + alpha log m-(2a-1)/((a-1)(2a-1))``.
* ``ADD_OR_REMOVE_ONE`` (zero-out: an absent client encodes 0): the larger of
  "remove" ``alpha c^2/2 + log m-_{K-1}(alpha, c)/(alpha - 1)`` and "add" ``alpha c^2/2``
  (alpha <= 2) or ``alpha c^2/2 + log m+_{K-1}(alpha - 1, c)/(alpha - 1)`` (alpha > 2).

Here ``m+_n(r, c) = E[Ybar_n^r]`` and ``m-_n(s, c) = E[Ybar_n^-s]`` for the mean ``Ybar_n`` of n
i.i.d. ``Y = exp(c G - c^2/2)``, ``G ~ N(0, 1)``. Both tend to 1 as K grows, so the bound tends
to the Gaussian mechanism's RDP (``2 alpha c^2`` replace-one, ``alpha c^2/2`` zero-out). The
bound depends only on c and K, not on the number of groups or the dimension. Since
``D_alpha`` is non-decreasing in alpha, the curve reported is ``min_{alpha' >= alpha}`` of the
bound. Orders above 256 are priced ``inf`` (never chosen by the conversion).

``m+`` and ``m-`` are computed in log space (a series by binary powering for ``m+``, an
integral over a tabulated Laplace transform for ``m-``, capped by the closed form
``m-_n <= m-_1 = e^{s(s+1)c^2/2}``); the numerics are told in
``privkit.accountants._rec_moments``.

**Client sampling with replacement** (``SampledWithReplacementDpEvent(N, 1, inner)``). Each
round the server makes |S'| independent uniform draws from a fixed, public population of
N = |S| clients; each draw sends one freshly seeded message. A run of T rounds is
``SelfComposedDpEvent(SampledWithReplacementDpEvent(N, 1, RecDpEvent(...)), T * |S'|)``,
priced under ``REPLACE_ONE`` with the general subsampled-RDP bound of Wang, Balle &
Kasiviswanathan (AISTATS 2019, Theorem 9) at gamma = 1/N, for integer alpha >= 2::

    eps'(alpha) = log(1 + gamma^2 C(alpha,2) min{4 (e^{eps(2)} - 1), 2 e^{eps(2)}}
                       + sum_{j=3}^{alpha} 2 gamma^j C(alpha,j) e^{(j-1) eps(j)}) / (alpha - 1)

(the theorem's factors ``min{2, (e^{eps(inf)} - 1)^j}`` equal 2 because REC, like the Gaussian,
has ``eps(inf) = inf``); between integers ``(alpha - 1) eps'(alpha)`` is interpolated linearly
(their Corollary 10; alpha in (1, 2) interpolates from 0 at alpha = 1). This *amplified*
(central) guarantee holds only if nobody it is stated against can link a message to a client and
the sampling outcome stays secret (an anonymising channel or a trusted sampler); against a
server that sees who sends what only the *local* guarantee, the plain composition of each
client's messages, holds. :func:`rec_epsilons` reports both.

Examples:
    >>> ev = RecDpEvent(noise_multiplier=2.0, num_candidates=16, num_groups=1)
    >>> [round(float(v), 4) for v in rec_rdp([2.0, 8.0], 2.0, 16)]
    [1.0933, 4.3031]
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from privkit import _validate
from privkit._dpa import dp_event
from privkit._lazy import LazyModule
from privkit.accountants import rdp as rdp_lib
from privkit.accountants import rules
from privkit.accountants._rec_moments import _R_MAX, MAX_ORDER, log_m_minus, log_m_plus
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import (
    MAX_CANDIDATES,
    RecDpEvent,
    SampledWithReplacementDpEvent,
    SelfComposedDpEvent,
    register_event_module,
)
from privkit.events.mechanisms import _relation_name

special = LazyModule("scipy.special")

__all__ = [
    "RecDpEvent",
    "MAX_ORDER",
    "log_m_plus",
    "log_m_minus",
    "rec_rdp",
    "rec_rdp_replace_one_pstar",
    "rec_rdp_zero_out",
    "subsampled_with_replacement_rdp",
    "rec_run_event",
    "rec_epsilons",
    "AMPLIFICATION_ASSUMPTION",
]

AMPLIFICATION_ASSUMPTION = (
    "amplification by sampling with replacement: a fixed public population of N clients, "
    "|S'| independent uniform draws per round, one freshly seeded message per draw, and nobody "
    "the guarantee is stated against can link a message to a client or learn the sample "
    "(anonymising channel or trusted sampler); otherwise only the local guarantee holds")


register_event_module(__name__)


# ------------------------------------------------------------------ one message
def _check_orders(orders: Any) -> np.ndarray:
    a = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if a.ndim != 1 or a.size == 0 or not np.all(np.isfinite(a)) or not np.all(a > 1):
        raise InvalidParameterError("orders", orders, "a non-empty list of finite orders > 1")
    return a


def _envelope(orders: np.ndarray, values: np.ndarray) -> np.ndarray:
    """min over alpha' >= alpha (D_alpha is non-decreasing in alpha)."""
    idx = np.argsort(orders, kind="stable")
    v = values[idx]
    env = np.minimum.accumulate(v[::-1])[::-1]
    out = np.empty_like(values)
    out[idx] = env
    return out


def rec_rdp_replace_one_pstar(orders: Any, noise_multiplier: float,
                              num_candidates: int) -> np.ndarray:
    """Theorem R at p* (replace-one), without the p grid or the envelope (spec 5.5)."""
    a = _check_orders(orders)
    c, n = _c_n(noise_multiplier, num_candidates)
    r = 2 * a - 1
    lp = log_m_plus(n, c, r)
    lm = log_m_minus(n, c, r)
    with np.errstate(invalid="ignore"):
        val = 2 * a * c * c + lp / r + a * lm / ((a - 1) * r)
    return np.where(a > MAX_ORDER, np.inf, val)


def _c_n(noise_multiplier: float, num_candidates: int) -> tuple[float, int]:
    z = _validate.positive("noise_multiplier", noise_multiplier)
    k = _validate.positive_int("num_candidates", num_candidates)
    if not 2 <= k <= MAX_CANDIDATES:
        raise InvalidParameterError("num_candidates", k, "in [2, 2**24]")
    return 1.0 / z, k - 1


def _replace_one(a: np.ndarray, c: float, n: int, grid_points: int) -> np.ndarray:
    out = rec_rdp_replace_one_pstar(a, 1.0 / c, n + 1)
    if grid_points <= 0:
        return out
    for i, alpha in enumerate(a):
        if alpha > MAX_ORDER:
            continue
        beta = alpha - 1
        pstar = (2 * alpha - 1) / beta
        p = pstar * np.exp(np.linspace(-1.5, 1.5, grid_points))
        p = p[(p > 1) & (beta * p >= 1) & (beta * p <= _R_MAX)]
        if p.size == 0:
            continue
        q = p / (p - 1)
        big_a = np.maximum(alpha * beta, alpha * alpha / (p - 1))
        big_b = np.maximum(alpha * beta, beta * beta * (p - 1))
        vals = ((big_a + big_b + 2 * alpha * beta) * c * c / 2
                + log_m_plus(n, c, beta * p) / p + log_m_minus(n, c, alpha * q) / q) / beta
        out[i] = min(out[i], float(np.min(vals)))
    return out


def rec_rdp_zero_out(orders: Any, noise_multiplier: float, num_candidates: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(add, remove) bounds of spec 5.6 (zero-out), before the envelope."""
    a = _check_orders(orders)
    c, n = _c_n(noise_multiplier, num_candidates)
    gauss = a * c * c / 2
    remove = gauss + log_m_minus(n, c, a) / (a - 1)
    add = gauss.copy()
    big = a > 2
    if big.any():
        add[big] = gauss[big] + log_m_plus(n, c, a[big] - 1) / (a[big] - 1)
    over = a > MAX_ORDER
    add[over] = np.inf
    remove[over] = np.inf
    return add, remove


@functools.lru_cache(maxsize=256)
def _rec_rdp_cached(orders: tuple[float, ...], z: float, k: int, relation: str,
                    grid_points: int) -> np.ndarray:
    a = np.asarray(orders, dtype=np.float64)
    c, n = _c_n(z, k)
    if relation == "REPLACE_ONE":
        vals = _replace_one(a, c, n, grid_points)
    else:
        add, remove = rec_rdp_zero_out(a, z, k)
        vals = np.maximum(add, remove)
    vals = np.where(np.isnan(vals), np.inf, vals)
    out = _envelope(a, vals)
    out.setflags(write=False)
    return out


def rec_rdp(orders: Any, noise_multiplier: float, num_candidates: int,
            neighboring_relation: Any = "REPLACE_ONE", *, grid_points: int = 60) -> np.ndarray:
    """RDP upper bound of one REC message at ``orders`` (Theorem R; see the module docstring).

    Args:
        orders: RDP orders alpha > 1 (non-integers allowed); orders > 256 give inf.
        noise_multiplier: sigma / C, > 0.
        num_candidates: K, integer in [2, 2**24].
        neighboring_relation: ``REPLACE_ONE`` or ``ADD_OR_REMOVE_ONE`` (zero-out).
        grid_points: size of the Hoelder p grid around p* (replace-one; 0: p* only).

    Returns:
        A float64 array, non-decreasing in alpha (the envelope ``min_{alpha' >= alpha}``).
    """
    a = _check_orders(orders)
    rel = _relation_name(neighboring_relation)
    gp = _validate.nonnegative_int("grid_points", grid_points)
    return np.array(_rec_rdp_cached(tuple(a.tolist()), float(noise_multiplier),
                                    int(num_candidates), rel, gp))


# ------------------------------------------------------------------ sampling with replacement
def subsampled_with_replacement_rdp(base: Any, population_size: int, orders: Any) -> np.ndarray:
    """Wang-Balle-Kasiviswanathan (AISTATS 2019) Thm 9 at gamma = 1/N: one draw of N.

    Args:
        base: callable ``orders -> RDP`` (replace-one) of the mechanism applied to the drawn
            client, evaluated at the integer orders 2..ceil(max order).
        population_size: N, the number of clients drawn from (gamma = 1/N), >= 1.
        orders: orders > 1 at which to return the amplified RDP.

    Returns:
        The amplified RDP of one draw (float64; inf where the base is inf).
    """
    n_pop = _validate.positive_int("population_size", population_size)
    a = _check_orders(orders)
    if n_pop == 1:
        return np.asarray(base(a), dtype=np.float64)
    top = int(min(math.ceil(a.max()), MAX_ORDER + 1))
    ints = np.arange(2, max(top, 2) + 1, dtype=np.float64)
    eps = np.asarray(base(ints), dtype=np.float64)
    if eps.shape != ints.shape or np.isnan(eps).any() or (eps < 0).any():
        raise InvalidParameterError("base", "its curve", "non-negative RDP values")
    log_g = -math.log(n_pop)
    amp = np.full(ints.shape, np.inf)
    e2 = eps[0]
    term2_inner = min(math.log(4.0) + math.log(math.expm1(e2)) if e2 > 0 else -math.inf,
                      math.log(2.0) + e2)
    for i, alpha in enumerate(ints.astype(np.int64)):
        if not np.isfinite(eps[: alpha - 1]).all():
            continue  # a base value that enters the sum is inf: the bound is inf
        lc2 = special.gammaln(alpha + 1) - special.gammaln(3) - special.gammaln(alpha - 1)
        terms = [0.0, 2 * log_g + lc2 + term2_inner]
        if alpha >= 3:
            j = np.arange(3, alpha + 1)
            lcj = (special.gammaln(alpha + 1) - special.gammaln(j + 1)
                   - special.gammaln(alpha - j + 1))
            terms.extend((math.log(2.0) + j * log_g + lcj + (j - 1) * eps[j - 2]).tolist())
        amp[i] = special.logsumexp(terms) / (alpha - 1)
    # (alpha - 1) eps'(alpha) interpolated between integers; 0 at alpha = 1.
    ys = np.concatenate([[0.0], (ints - 1) * amp])
    out = np.full(a.shape, np.inf)
    for i, alpha in enumerate(a):
        if alpha > ints[-1]:
            continue
        lo = int(math.floor(alpha))
        hi = lo + 1 if lo < alpha else lo
        ylo, yhi = ys[lo - 1], ys[hi - 1]
        if not (np.isfinite(ylo) and np.isfinite(yhi)):
            continue
        val = ylo + (alpha - lo) * (yhi - ylo) if hi != lo else ylo
        out[i] = val / (alpha - 1)
    return out


def rec_run_event(*, noise_multiplier: float, num_candidates: int, population_size: int,
                  messages: int, num_groups: int = 1) -> dp_event.DpEvent:
    """The amplified event of ``messages`` with-replacement draws (T * |S'| in a run).

    Examples:
        >>> ev = rec_run_event(noise_multiplier=2.0, num_candidates=256, population_size=1000,
        ...                    messages=10_000)
        >>> ev.count, ev.event.source_dataset_size
        (10000, 1000)
    """
    inner = RecDpEvent(noise_multiplier, num_candidates, num_groups, "REPLACE_ONE")
    n = _validate.positive_int("population_size", population_size)
    t = _validate.positive_int("messages", messages)
    return SelfComposedDpEvent(SampledWithReplacementDpEvent(n, 1, inner), t)


def rec_epsilons(*, noise_multiplier: float, num_candidates: int, population_size: int,
                 draws_per_round: int, rounds: int, delta: float,
                 messages_of_client: int | None = None) -> dict[str, Any]:
    """Central (amplified) and local epsilon of a DP-REC run, with their assumptions.

    Args:
        noise_multiplier: sigma / C.
        num_candidates: K.
        population_size: N = |S| clients.
        draws_per_round: |S'|, draws with replacement per round.
        rounds: T.
        delta: delta of both guarantees.
        messages_of_client: messages one client actually sent (local guarantee); default the
            expected number T |S'| / N, rounded up.

    Returns:
        ``{"central": {...}, "local": {...}}``, each with epsilon, order, method and assumptions.

    Examples:
        >>> r = rec_epsilons(noise_multiplier=2.0, num_candidates=256, population_size=1000,
        ...                  draws_per_round=10, rounds=1000, delta=1e-5, messages_of_client=10)
        >>> round(r["central"]["epsilon"], 2), round(r["local"]["epsilon"], 2)
        (1.05, 19.12)
    """
    from privkit.accountants.accountant import epsilon as price

    d = _validate.delta("delta", delta)
    s = _validate.positive_int("draws_per_round", draws_per_round)
    t = _validate.positive_int("rounds", rounds)
    n = _validate.positive_int("population_size", population_size)
    k_i = (math.ceil(t * s / n) if messages_of_client is None
           else _validate.nonnegative_int("messages_of_client", messages_of_client))
    central_ev = rec_run_event(noise_multiplier=noise_multiplier, num_candidates=num_candidates,
                               population_size=n, messages=t * s)
    central = price(central_ev, d, "rdp", neighboring_relation=NeighboringRelation.REPLACE_ONE)
    out: dict[str, Any] = {"central": central.to_dict() | {"event": "T*|S'| draws at 1/N"}}
    if k_i == 0:
        out["local"] = {"epsilon": 0.0, "delta": d, "method": "none (no messages)",
                        "assumptions": []}
    else:
        local_ev = SelfComposedDpEvent(RecDpEvent(noise_multiplier, num_candidates), k_i)
        local = price(local_ev, d, "rdp", neighboring_relation=NeighboringRelation.REPLACE_ONE)
        out["local"] = local.to_dict() | {"messages": k_i}
    return out


# ------------------------------------------------------------------ accounting rules
def _effective_relation(event: RecDpEvent, relation: Any) -> str:
    # The replace-one curve bounds every pair of the ball, the zero-out pairs included.
    if event.neighboring_relation == "REPLACE_ONE" or relation == NeighboringRelation.REPLACE_ONE:
        return "REPLACE_ONE"
    return "ADD_OR_REMOVE_ONE"


@rules.rdp_curve.register
def _(event: RecDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    return rec_rdp(orders, event.noise_multiplier, event.num_candidates,
                   _effective_relation(event, relation))


# RecDpEvent's noise multiplier is already sigma / C, and its own neighboring_relation picks
# its curve (_effective_relation): nothing to re-express.
rules.relative_to_sensitivity.register(RecDpEvent, rules.guarantee_event)


@rules.notes.register
def _(event: RecDpEvent) -> tuple[str, ...]:
    return ("REC message: Theorem R RDP bound (derived, numerically checked; not the paper's "
            "Theorem 1); fresh unique seeds; selection randomness private to the client",)


@rules.check_atom.register
def _(event: SampledWithReplacementDpEvent) -> None:
    _validate.positive_int("SampledWithReplacementDpEvent.source_dataset_size",
                           event.source_dataset_size)
    _validate.positive_int("SampledWithReplacementDpEvent.sample_size", event.sample_size)
    inner = event.event
    if isinstance(inner, (dp_event.ComposedDpEvent, dp_event.SelfComposedDpEvent)):
        raise UnsupportedEventError("SampledWithReplacementDpEvent of a composition is not "
                                    "supported")
    rules.check_atom(inner)


@rules.rdp_curve.register
def _(event: SampledWithReplacementDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    if int(event.sample_size) != 1:
        raise UnsupportedEventError("sampling with replacement is priced for sample_size 1 "
                                    "(one draw per event; compose T*|S'| of them)")
    if relation != NeighboringRelation.REPLACE_ONE:
        raise UnsupportedEventError("sampling with replacement from a fixed population is "
                                    "priced under REPLACE_ONE only (pass neighboring_relation="
                                    "REPLACE_ONE)")
    inner = event.event
    return subsampled_with_replacement_rdp(
        lambda o: rules.rdp_curve(inner, np.asarray(o, dtype=np.float64),
                                  NeighboringRelation.REPLACE_ONE),
        int(event.source_dataset_size), orders)


@rules.notes.register
def _(event: SampledWithReplacementDpEvent) -> tuple[str, ...]:
    return (AMPLIFICATION_ASSUMPTION,
            "subsampled RDP: Wang, Balle & Kasiviswanathan 2019, Thm 9 (general bound)",
            *rules.notes(event.event))


def rdp_orders() -> np.ndarray:
    """The order grid privkit's accountants use (re-exported for convenience)."""
    return rdp_lib.ORDERS.copy()
