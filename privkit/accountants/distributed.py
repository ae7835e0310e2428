"""Privacy of the distributed Skellam mechanism (Gaussian-DP, and Renyi-DP where sampled), its
calibration and its wrap-around bound.

**One release** (:class:`~privkit.events.distributed.SkellamDpEvent`). Each of at least ``n``
honest surviving clients adds ``Skellam(mu)`` noise (variance ``mu`` per coordinate, integer
units); Poisson sums are Poisson, so the sum carries ``Skellam(n mu)``. A client's rounded
contribution has L2 norm at most ``Delta_2`` and L1 norm at most ``Delta_1``. Agarwal, Kairouz &
Liu (NeurIPS 2021, "The Skellam Mechanism for Differentially Private Federated Learning",
Theorem 3.5, the multi-dimensional Skellam mechanism) bound the Renyi divergence of two
Skellam vectors of variance ``M = n mu`` shifted by such a vector, for integer orders
``alpha > 1``::

    eps(alpha) = alpha Delta_2^2 / (2 M) + min(((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (4 M^2),
                                               3 Delta_1 / (2 M)).

The first term is the Gaussian mechanism's RDP at variance ``M``; the second vanishes as
``M`` grows (:func:`skellam_rdp`). Between integer orders the bound interpolates
``(alpha - 1) eps(alpha)`` linearly (the cumulant ``(alpha - 1) D_alpha`` is convex in
``alpha``), so every order of privkit's grid gets a valid value. More noise (more survivors
than ``n``) is a post-processing (adding independent Skellam noise) and can only help.

**Gaussian-DP, the price of an unsampled release** (:func:`skellam_gdp_mu`;
:mod:`privkit.accountants._skellam_gdp` has the argument). The Skellam's mass function is
log-concave, so the tradeoff curve of ``(X, X + 1)``, ``X ~ Skellam(M)``, is known exactly
and the smallest ``mu_1`` with that pair ``mu_1``-GDP is ``sup_s [Phi^{-1}(F(s)) -
Phi^{-1}(F(s - 1))]`` (``F`` the CDF), computed (:func:`skellam_unit_gdp`; ``mu_1 sqrt(M) -> 1``:
``1 + 1.7e-5`` at ``M = 10^4``, ``1 + 3e-7`` at ``10^6``). A shift by ``c`` is then
``c mu_1``-GDP (the sup telescopes) and a release moving an integer vector of L2 norm at most
``Delta_2`` is ``mu_1 Delta_2``-GDP (the coordinates compose): the Gaussian mechanism of the
same variance, priced exactly, instead of the Renyi bound above, whose conversion to
(epsilon, delta) asks 6-8% more noise. The analysis replaces the Skellam's tails beyond
``~21`` standard deviations by geometric ones (a law within total variation ``1e-100`` per
coordinate, :data:`TAIL_TV`), so a composition of ``k`` releases carries
``(1 + e^epsilon) k Delta_1 1e-100`` more delta: the accountant adds it
(:func:`privkit.accountants.rules.delta_slack`), and prices by the Renyi bound instead
where that would not be negligible (epsilon near 700). Used for releases every client takes
part in (``sampling_probability`` 1: every client every round, and the composition against the
server) and, by joint convexity (a sampled round is dominated by the unsampled one), as the
"sampling rates set to 1" candidate of a sampled one; at central variances outside
``[1, 2^40]`` (:data:`MAX_GDP_VARIANCE`) only the Renyi bound prices the event.

**Relations.** Under zero-out (``REPLACE_SPECIAL``; the client keeps its place and its noise
share, its update becomes zero) the shift is one contribution; under ``REPLACE_ONE`` the
difference of two, and :func:`privkit.accountants.rules.relative_to_sensitivity` doubles both
sensitivities. ``ADD_OR_REMOVE_ONE`` is refused: the client's noise share comes and goes with
it, so the neighbouring sums differ in their noise as well as by a shift.

**Rounding and delta.** The sensitivities come from the conditional rounding's bound ``T``
(:func:`~privkit.events.distributed.rounded_norm_bound_sq`; Kairouz, Liu & Steinke, ICML 2021,
Section 4.1), which the mechanism *enforces*: it redraws the rounding until the bound holds
and falls back to rounding towards zero. The bound therefore fails with probability 0, and
``delta_total = delta_rdp``: the rounding's failure probability ``beta`` only costs retries
(expected tries at most ``1 / (1 - beta)``) and a small bias. (Unconditional rounding priced
at the conditional bound would need ``delta_rdp + (1 + e^eps) k beta`` instead, ``k`` the
rounds a client takes part in, by a total-variation argument; privkit does not offer it.)

**Composition and sampling.** RDP adds over rounds. With Poisson client sampling at rate
``q`` and the cohort secret, a round's two output laws are ``(1 - q) A + q B`` and
``(1 - q) A + q B'``, where ``A`` is the sum without the client and ``B``, ``B'`` the sums with
it (its two updates, the same noise): ``A`` also lacks the client's noise share, so the
add/remove subsampling lemmas (Zhu & Wang 2019; Mironov, Talwar & Zhang 2019), whose base
mechanism must be the same with and without the client, do not apply. privkit uses joint
convexity of ``exp((alpha - 1) D_alpha)`` (an f-divergence) instead::

    eps_q(alpha) = log(1 + q (exp((alpha - 1) eps(alpha)) - 1)) / (alpha - 1),

valid for any pair of mixtures with a common component (:func:`sampled_rdp`). It amplifies
far less than the central mode's Poisson lemma (roughly ``q eps`` where ``eps`` is small, an
additive ``log(1/q)`` where it is not), and holds only against those who do not know the
cohort: the server, which picks it, gets the unamplified composition
(:meth:`privkit.mechanisms.DistributedSkellam.unamplified_event`).

**Wrap-around** (:func:`wraparound_probability`) is a utility failure, not a privacy one:
the released residue is a post-processing of the noisy integer sum whatever it is.

Example:
    >>> import privkit
    >>> ev = SkellamDpEvent(noise_per_client=1e4, survivors=100, l2_sensitivity=300.0,
    ...                     l1_sensitivity=9600.0)
    >>> r = privkit.epsilon(privkit.SelfComposedDpEvent(ev, 10), 1e-5,
    ...                     neighboring_relation="zero-out")
    >>> round(r.epsilon, 4), r.method   # the Gaussian of variance 1e6, exactly: 4.1186
    (4.1186, 'exact')
    >>> r = privkit.epsilon(privkit.SelfComposedDpEvent(ev, 10), 1e-5, "rdp",
    ...                     neighboring_relation="zero-out")
    >>> round(r.epsilon, 3)   # zCDP of the same Gaussian-DP
    4.451
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from privkit import _validate
from privkit.accountants import rules
from privkit.accountants._methods import Method
from privkit.accountants._skellam import (
    GDP_NOTE,
    SAMPLING_NOTE,
    SKELLAM_NOTE,
    sampled_rdp,
    skellam_gdp_mu,
    skellam_rdp,
)
from privkit.accountants._skellam_gdp import MAX_GDP_VARIANCE, TAIL_TV, skellam_unit_gdp
from privkit.accountants._wraparound import (
    finest_granularity,
    skellam_chernoff_tail,
    wraparound_probability,
)
from privkit.errors import InvalidParameterError
from privkit.events import DpEvent, SelfComposedDpEvent
from privkit.events.distributed import (
    DISTRIBUTED_TRUST_ASSUMPTION,
    MAX_NOISE_PER_CLIENT,
    SkellamDpEvent,
    check_bits,
    honest_shares,
    padded_dimension,
    rounded_norm_bound_sq,
    skellam_relation,
    skellam_sensitivities,
)

__all__ = [
    "SkellamDpEvent",
    "DISTRIBUTED_TRUST_ASSUMPTION",
    "DistributedCalibration",
    "skellam_rdp",
    "sampled_rdp",
    "skellam_unit_gdp",
    "skellam_gdp_mu",
    "MAX_GDP_VARIANCE",
    "TAIL_TV",
    "skellam_chernoff_tail",
    "wraparound_probability",
    "finest_granularity",
    "released_rate",
    "calibrate_distributed",
    "SKELLAM_NOTE",
    "GDP_NOTE",
    "SAMPLING_NOTE",
]

# ------------------------------------------------------------------ calibration
@dataclass(frozen=True)
class DistributedCalibration:
    """A calibrated distributed Skellam mechanism and what it costs against central DP.

    Errors are mean squared errors per coordinate of the decoded mean (the sum divided by
    ``clients``) when all ``clients`` take part: ``mse_noise = gamma^2 clients mu / clients^2``
    (the Skellam noise, exact), ``mse_rounding <= gamma^2 (clients / 4) / clients^2``
    (unconditional randomized rounding's variance; the conditioning's small bias is not
    counted), and ``central_mse = (z C)^2 / clients^2`` for
    :class:`~privkit.mechanisms.ClientLevelGaussian` with the noise multiplier ``z`` calibrated to
    the same target, rounds, sampling and relation by privkit's tightest method
    (``central_rdp_mse``: by RDP, which the Skellam was priced with before its Gaussian-DP).
    Clipping bias is the same in both and not counted.
    """

    noise_per_client: float
    granularity: float
    bits: int
    dim: int
    padded_dim: int
    norm_bound_sq: int
    l2_sensitivity: float
    l1_sensitivity: float
    epsilon: float
    delta: float
    target_epsilon: float
    rounds: int
    clients: int
    min_survivors: int
    colluders: int
    sampling_probability: float
    neighboring_relation: str
    beta: float
    clip: float
    wrap_probability: float
    mse_noise: float
    mse_rounding: float
    central_noise_multiplier: float
    central_epsilon: float
    central_mse: float
    central_rdp_noise_multiplier: float
    central_rdp_mse: float
    method: str

    @property
    def mse(self) -> float:
        """mse_noise + mse_rounding."""
        return self.mse_noise + self.mse_rounding

    @property
    def mse_ratio(self) -> float:
        """mse / central_mse: what distributing the trust costs, against the central mode
        priced by privkit's tightest method (exact or PLD)."""
        return self.mse / self.central_mse

    @property
    def mse_ratio_rdp(self) -> float:
        """mse / central_rdp_mse: the cost against the central mode priced by RDP too (the
        mechanism's own cost: discreteness, rounding, dropouts, bit width)."""
        return self.mse / self.central_rdp_mse

    def event(self) -> DpEvent:
        """One round's event (Poisson-sampled when sampling_probability < 1)."""
        return SkellamDpEvent(self.noise_per_client, self.min_survivors - self.colluders,
                              self.l2_sensitivity, self.l1_sensitivity,
                              self.sampling_probability)

    def mechanism_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`privkit.mechanisms.DistributedSkellam` for this
        calibration."""
        return {"l2_clip_norm": self.clip, "granularity": self.granularity,
                "noise_per_client": self.noise_per_client, "bits": self.bits, "dim": self.dim,
                "min_survivors": self.min_survivors, "colluders": self.colluders,
                "beta": self.beta, "sampling_probability": self.sampling_probability}


def released_rate(num_clients: int, rate: float, min_survivors: int) -> float:
    """``q' = P(client in the cohort | cohort >= n_min)`` for Poisson sampling of N clients at
    rate p: ``p P(Bin(N - 1, p) >= n_min - 1) / P(Bin(N, p) >= n_min)``, rounded up and kept
    in [p, 1]: the rate a *released* round is amplified at when rounds with fewer than
    ``min_survivors`` clients are skipped (joint convexity; against outsiders only). Used by
    the trainers' distributed mode and by :class:`privkit.flower.DistributedDP`.

    Example:
        >>> round(released_rate(2000, 0.05, 78), 5), released_rate(20, 1.0, 20)
        (0.05011, 1.0)
    """
    n = _validate.positive_int("num_clients", num_clients)
    p = _validate.probability("rate", rate)
    k = _validate.positive_int("min_survivors", min_survivors)
    if p == 1:
        return p
    from scipy.stats import binom

    den = float(binom.sf(k - 1, n, p))  # P(Bin(N, p) >= k)
    if not den > 0:
        return 1.0
    num = float(binom.sf(k - 2, n - 1, p)) if k >= 2 else 1.0  # P(Bin(N-1, p) >= k-1)
    return float(min(1.0, max(p, p * num / den * (1 + 1e-9))))


def calibrate_distributed(target_epsilon: float, delta: float, rounds: int, clients: int,
                          min_survivors: int, dim: int, clip: float, bits: int,
                          sampling_probability: float = 1.0, *, colluders: int = 0,
                          beta: float = math.exp(-0.5),
                          neighboring_relation: Any = "zero-out",
                          max_wrap_probability: float = 1e-6,
                          granularity: float | None = None) -> DistributedCalibration:
    """The per-client noise and the granularity of a distributed Skellam run, and its cost.

    The granularity gamma is the finest grid (least rounding error, least norm inflation)
    whose wrap-around bound (:func:`wraparound_probability`, with all ``clients`` taking part
    and adding noise) is at most ``max_wrap_probability`` per round, searched with the noise
    the Renyi bound asks (no less than the final noise; checked again at the answer); at that
    gamma the noise ``mu`` per client is the smallest whose ``rounds``-fold composition, with
    ``min_survivors - colluders`` honest shares, has epsilon <= ``target_epsilon`` by privkit's
    tightest method (Gaussian-DP where every client takes part, module docstring;
    :func:`privkit.accountants.calibration.calibrate_noise`, verified at the answer).

    Args:
        target_epsilon: finite and > 0.
        delta: in (0, 1); nothing is added for the rounding (module docstring).
        rounds: releases composed, >= 1 (with sampling, rounds of the run).
        clients: clients per round (the public divisor, and the most contributions a sum
            holds), >= 1.
        min_survivors: the fewest clients a released sum may contain, 1..clients.
        dim: coordinates of one update, >= 1.
        clip: C, the L2 clip norm, > 0.
        bits: the SecAgg modulus exponent, 2..62.
        sampling_probability: q in (0, 1]; < 1 uses the (weak) amplification of the module
            docstring, which holds only against those who do not know the cohort.
        colluders: clients that may collude with the server, < min_survivors.
        beta: the conditional rounding's parameter in [0, 1).
        neighboring_relation: zero-out (default) or replace-one; add/remove is refused.
        max_wrap_probability: the per-round wrap-around bound to meet, in (0, 1).
        granularity: use this gamma instead of choosing one (its wrap bound is reported).

    Raises:
        InvalidParameterError: a bad argument, or bits too few for ``clients`` at any grid.

    Example:
        >>> cal = calibrate_distributed(3.0, 1e-5, rounds=10, clients=50, min_survivors=50,
        ...                             dim=100, clip=1.0, bits=16)
        >>> cal.epsilon <= 3.0, cal.wrap_probability <= 1e-6, 1.0 < cal.mse_ratio < 1.2
        (True, True, True)
    """
    # imported here: privkit.accountants imports this module, and calibration is not needed
    # to price an event (import privkit stays light)
    from privkit.accountants.calibration import calibrate_noise, calibrate_noise_multiplier

    target = _validate.positive("target_epsilon", target_epsilon)
    dl = _validate.delta("delta", delta)
    t = _validate.positive_int("rounds", rounds)
    n = _validate.positive_int("clients", clients)
    n_min = _validate.positive_int("min_survivors", min_survivors)
    if n_min > n:
        raise InvalidParameterError("min_survivors", min_survivors, f"<= clients = {n}")
    honest = honest_shares(n_min, colluders)
    k = n_min - honest
    d = padded_dimension(dim)
    c_norm = _validate.positive("clip", clip)
    b = check_bits(bits)
    q = _validate.probability("sampling_probability", sampling_probability)
    rel = skellam_relation(neighboring_relation)
    wrap_max = _validate.probability("max_wrap_probability", max_wrap_probability)
    if wrap_max >= 1:
        raise InvalidParameterError("max_wrap_probability", max_wrap_probability, "< 1")
    rounded_norm_bound_sq(1.0, d, beta)  # validates beta

    def sens(gamma: float) -> tuple[int, float, float]:
        tsq = rounded_norm_bound_sq(c_norm / gamma, d, beta)
        l2, l1 = skellam_sensitivities(tsq, d)
        return tsq, l2, l1

    def noise(gamma: float, method: Method = Method.AUTO) -> tuple[float, float, str]:
        _, l2, l1 = sens(gamma)

        def make(mu: float) -> DpEvent:
            return SelfComposedDpEvent(SkellamDpEvent(mu, honest, l2, l1, q), t)

        guess = max(1.0, (l2 * l2) / honest)
        return calibrate_noise(make, target_epsilon=target, delta=dl, method=method,
                               tol=1e-9, initial_guess=guess, neighboring_relation=rel)

    def wrap(gamma: float, method: Method = Method.AUTO) -> float:
        if method is Method.RDP:
            # the noise the Skellam's RDP bound alone asks (no less than the final one where
            # its Gaussian-DP prices it): every atom priced as it is
            with rules.without_nearby_laws():
                mu = noise(gamma, method)[0]
        else:
            mu = noise(gamma, method)[0]
        if mu > MAX_NOISE_PER_CLIENT:
            return math.inf  # a grid this fine needs more noise than a client may draw
        return wraparound_probability(clients=n, noise_per_client=mu, scaled_clip=c_norm / gamma,
                                      padded_dim=d, bits=b)

    if granularity is not None:
        gamma = _validate.positive("granularity", granularity)
        finest = c_norm / (2.0**30 - math.sqrt(d) - 2.0)  # finest_granularity's int64 limit
        if gamma < finest:
            raise InvalidParameterError("granularity", granularity, f">= {finest!r} (int64)")
    else:
        # the grid is searched with the noise the RDP bound asks (fast, and no less than the
        # final noise, so the grid's wrap bound holds a fortiori); checked below, and searched
        # again with the final pricing in the rare case it does not hold
        coarse = f"enough for {n} clients: the sum of their rounding errors alone nears " \
                 f"2^{b - 1} (raise bits or max_wrap_probability)"
        gamma = finest_granularity(
            lambda g: wrap(g, Method.RDP), clip=c_norm, padded_dim=d,
            max_wrap_probability=wrap_max, bits=bits, too_coarse=coarse)
        if wrap(gamma) > wrap_max:
            gamma = finest_granularity(wrap, clip=c_norm, padded_dim=d,
                                       max_wrap_probability=wrap_max, bits=bits,
                                       too_coarse=coarse)
    mu, eps, method = noise(gamma)
    if mu > MAX_NOISE_PER_CLIENT:
        raise InvalidParameterError("granularity", gamma,
                                    f"coarse enough that the noise per client ({mu:.3g}) is "
                                    "<= 2^51")
    tsq, l2, l1 = sens(gamma)
    wrap_p = wraparound_probability(clients=n, noise_per_client=mu, scaled_clip=c_norm / gamma,
                                    padded_dim=d, bits=b)
    # the central mode at the same target, rounds, sampling and relation
    central = calibrate_noise_multiplier(target_epsilon=target, delta=dl, steps=t,
                                         sampling_probability=q, neighboring_relation=rel)
    z = central.noise_multiplier
    z_rdp = calibrate_noise_multiplier(target_epsilon=target, delta=dl, steps=t,
                                       sampling_probability=q, method=Method.RDP,
                                       neighboring_relation=rel).noise_multiplier
    g2 = gamma * gamma / (n * n)
    return DistributedCalibration(
        noise_per_client=mu, granularity=gamma, bits=b, dim=int(dim), padded_dim=d,
        norm_bound_sq=tsq, l2_sensitivity=l2, l1_sensitivity=l1, epsilon=eps,
        delta=dl, target_epsilon=target, rounds=t, clients=n, min_survivors=n_min,
        colluders=k, sampling_probability=q, neighboring_relation=rel.name, beta=float(beta),
        clip=c_norm, wrap_probability=wrap_p, mse_noise=g2 * n * mu, mse_rounding=g2 * n / 4.0,
        central_noise_multiplier=z, central_epsilon=central.epsilon,
        central_mse=(z * c_norm) ** 2 / (n * n), central_rdp_noise_multiplier=z_rdp,
        central_rdp_mse=(z_rdp * c_norm) ** 2 / (n * n), method=method)
