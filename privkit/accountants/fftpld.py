"""privkit's own privacy-loss-distribution (PLD) accountant for Gaussian-family events.

It prices compositions of Gaussian and Poisson-subsampled Gaussian mechanisms (any mix of
noise multipliers, sampling rates and counts) and of pure epsilon-DP steps, under
``ADD_OR_REMOVE_ONE`` or ``REPLACE_ONE``, as a **pessimistic** (upper-bound) epsilon or delta.
Three steps, each one-sided:

1. **One step, connect-the-dots** (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi, PETS 2022).
   The privacy loss ``L = log(p/q)`` of one use, seen under ``P``, is moved onto the grid
   ``{k h}``: a loss value in ``[k h, (k+1) h)`` is split between the two grid points so that
   the mass and the ``e^-L`` mass are kept. The hockey-stick curve of the result interpolates
   the true one linearly in ``e^eps``; the true curve is convex in ``e^eps``, so the result
   dominates it, and domination is kept by composition. The split masses are integrals over
   ``x`` computed by Gauss-Legendre quadrature on short pieces (no cancellation); the far upper
   tail (``P``-mass below a stated budget) is moved to ``L = +inf`` and the far lower tail up to
   the lowest grid point, both pessimistic.
2. **Composition by one FFT**: the composed PMF is ``irfft(prod_j rfft(p_j)^{n_j})`` on a window
   of ``N`` grid points. Mass that wraps around from below lands at high losses (pessimistic);
   the mass that would wrap from above is bounded by a Chernoff bound computed from the
   one-step PMFs and added to delta.
3. **Reading the curve**: ``delta(eps) = P_inf + sum_k c_k (1 - e^(eps - k h))_+`` is exact for
   the discrete PMF; epsilon for a target delta solves it in closed form within a grid cell,
   after subtracting every allowance from the target.

Floating point: the FFT's rounding error in delta grows with the number of factors of the
FFT power; every answer carries an allowance for it (:data:`SLACK_PER_FACTOR`, measured), and
an FFT runs in extended precision when double precision's allowance would matter.

The grid interval ``h`` is chosen in closed form, without trial compositions: the split adds at
most ``h^2/8`` to the mean and ``h^2/4`` to the variance of each step's loss, so ``T`` steps
move epsilon by about ``T h^2 (1 + zeta/s)/8``, where ``s`` is the composed loss's standard
deviation and ``zeta = sqrt(2 log(1/delta))``; ``h`` is set so that this is at most
:data:`RELATIVE_ERROR` of the cheap RDP estimate of epsilon (a tightness target only: any
``h`` gives a valid upper bound). When the window would exceed :data:`MAX_POINTS`, ``h`` is
made coarser (still an upper bound, a looser one).

Units: losses and epsilons in nats. Noise multipliers follow privkit's convention
(``z = stddev / Delta``, ``Delta`` the L2 sensitivity under the relation priced; for
``REPLACE_ONE`` a Poisson-sampled sum of contributions clipped to ``C`` has ``Delta = 2 C``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from privkit.accountants._atoms import GaussianAtom, PureAtom
from privkit.accountants._pld_compose import (
    _as_pmf,
    _compose,
    _compose_counts,
    _Composed,
    _epsilon_of,
    _hockey,
)
from privkit.accountants._pld_step import (
    MAX_POINTS,
    _directions,
    _gaussian_pmf,
    _moments,
    _Pair,
    _Pmf,
    _pmfs,
    _TooFine,
)
from privkit.errors import NumericalError, UnsupportedEventError

__all__ = [
    "GaussianAtom",
    "PureAtom",
    "Curve",
    "WindowTooLarge",
    "curve",
    "epsilon",
    "epsilon_above",
    "delta",
    "estimate",
    "plan",
    "choose_interval",
    "RELATIVE_ERROR",
    "MAX_POINTS",
    "SLACK_PER_FACTOR",
]

#: Target relative distance of epsilon above the exact value (the grid is chosen for it).
RELATIVE_ERROR = 5e-6
#: Allowance in delta for floating-point error, per factor of an FFT power: 5e-16 in double
#: precision (the largest error measured against extended precision was 1.3e-16, 1.2 unit
#: roundoffs), 2.5e-19 in extended precision (the same 1.2 of its unit roundoff 2^-64, with the
#: same 4x margin). A block's error carries into every use of the block, so a two-stage
#: composition of T steps in B blocks is allowed ``a1 T + a2 B``. An FFT runs in extended
#: precision when double's allowance would exceed :data:`_EXTENDED_ABOVE` of the target delta.
SLACK_PER_FACTOR = {False: 5e-16, True: 2.5e-19}
_EXTENDED_ABOVE = 1e-4
#: The tails moved (to +inf, or up to the lowest grid point) and the wrap-around bound each
#: get at most this share of the target delta.
_TAIL_SHARE = 1e-6


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class _Plan:
    """Grids and blocks: steps are composed ``block`` at a time on the fine grid, each block
    re-discretised onto the coarse grid and the blocks composed there (one stage when
    ``block == 1``, then both grids are equal)."""

    fine: float
    coarse: float
    block: int


#: Compositions of at most this many steps are done in one stage.
_ONE_STAGE = 64


def plan(atoms: list[tuple[Any, int]], eps_estimate: float, delta: float) -> _Plan:
    """Grids for a target relative error (module doc), from a cheap estimate of epsilon."""
    steps = sum(n for _, n in atoms)
    zeta = math.sqrt(2 * math.log(1 / delta))
    # The composed loss's spread, from coarse one-step PMFs (no composition).
    h0 = min(max(eps_estimate, 1e-6) / 64, 0.05)
    var = 0.0
    for atom, n in atoms:
        if isinstance(atom, PureAtom):
            var += n * atom.epsilon ** 2
            continue
        pair = _Pair("remove", atom.noise_multiplier, atom.sampling_probability)
        h1 = h0
        while True:
            try:
                var += n * _moments(_gaussian_pmf(pair, h1, 1e-12), h1)[1]
                break
            except _TooFine:
                h1 *= 8
    factor = 1 + zeta / math.sqrt(max(var, 1e-300))
    budget = 8 * RELATIVE_ERROR * max(eps_estimate, 1e-9) / factor  # sum over splits of h^2
    if steps <= _ONE_STAGE:
        h = math.sqrt(budget / steps)
        return _Plan(h, h, 1)
    block = 1 << round(math.log2(math.sqrt(steps)))
    blocks = sum(-(-n // min(block, n)) for _, n in atoms)
    return _Plan(math.sqrt(budget / (2 * steps)), math.sqrt(budget / (2 * blocks)), block)


def estimate(atoms: list[tuple[Any, int]], delta: float) -> float:
    """A cheap, smooth guess of epsilon that plans the grid when the caller has none: the CLT
    (Gaussian-DP) value with mu^2 = sum_j n_j q_j^2 (e^{1/z_j^2} - 1) (n / z^2 without sampling,
    n eps^2 for pure steps). Not a bound; it only sets how fine the grid is, and
    :func:`epsilon` re-plans once when the answer comes out far below it."""
    from privkit.accountants.gaussian import exact_epsilon

    mu2 = 0.0
    for atom, n in atoms:
        if isinstance(atom, PureAtom):
            mu2 += n * atom.epsilon ** 2
            continue
        z, q = max(atom.noise_multiplier, 1e-100), atom.sampling_probability
        inv = min(1 / (z * z), 700.0)
        mu2 += n * min(inv, q * q * math.expm1(inv))  # the unsampled value bounds it too
    return max(float(exact_epsilon(math.sqrt(mu2), delta)), 1e-6)


def choose_interval(atoms: list[tuple[Any, int]], eps_estimate: float, delta: float) -> float:
    """The (fine) grid interval :func:`plan` chooses."""
    return plan(atoms, eps_estimate, delta).fine


@dataclass(frozen=True)
class _Precision:
    """Extended precision per stage and the floating-point allowance it implies."""

    stage1: bool
    stage2: bool
    slack: float


def _precision(atoms: list[tuple[Any, int]], p: _Plan, target: float) -> _Precision:
    steps = _steps(atoms)
    factors = steps if p.block == 1 else sum(-(-n // min(p.block, n)) for _, n in atoms)
    a64 = SLACK_PER_FACTOR[False]
    ext1 = p.block > 1 and a64 * steps > _EXTENDED_ABOVE * target
    ext2 = a64 * factors > _EXTENDED_ABOVE * target
    slack = SLACK_PER_FACTOR[ext2] * factors
    if p.block > 1:
        slack += SLACK_PER_FACTOR[ext1] * steps
    return _Precision(ext1, ext2, slack)


def _composed(atoms: list[tuple[Any, int]], direction: str, p: _Plan, prec: _Precision,
              budget: float, tail: float) -> _Composed:
    if p.block == 1:
        return _compose(_pmfs(atoms, direction, p.fine, budget), p.fine, tail,
                        extended=prec.stage2)
    blocks: list[tuple[_Pmf, int]] = []
    nblocks = sum(-(-n // min(p.block, n)) for _, n in atoms)
    for (one, n) in _pmfs(atoms, direction, p.fine, budget):
        size = min(p.block, n)
        full, rest = divmod(n, size)
        parts = [(cnt, times) for cnt, times in ((size, full), (rest, 1)) if cnt and times]
        comps = _compose_counts(one, [cnt for cnt, _ in parts], p.fine, tail / nblocks,
                                prec.stage1)
        for comp, (_, times) in zip(comps, parts, strict=True):
            blocks.append((_as_pmf(comp, p.coarse), times))
    return _compose(blocks, p.coarse, tail, extended=prec.stage2)


def _priced(atoms: list[tuple[Any, int]], relation: str, p: _Plan, target: float,
            budget: float, tail: float) -> tuple[list[_Composed], float]:
    """The composed PMF of each direction and the floating-point allowance."""
    while True:
        prec = _precision(atoms, p, target)
        try:
            return [_composed(atoms, d, p, prec, budget, tail)
                    for d in _directions(atoms, relation)], prec.slack
        except _TooFine as exc:
            grow = 1.05 * exc.n / MAX_POINTS
            p = _Plan(p.fine * grow, p.coarse * grow, p.block)


class Curve:
    """A composed pessimistic PLD on one fixed grid, every direction, with its allowances:
    ``delta(eps)`` is non-increasing in eps (one PMF answers every query)."""

    def __init__(self, comps: list[_Composed], slack: float) -> None:
        self._comps, self.slack = comps, slack

    @property
    def interval(self) -> float:
        return self._comps[0].h

    def delta(self, eps: float) -> float:
        worst = max(_hockey(c, eps) + c.wrap_bound for c in self._comps)
        return min(1.0, worst + self.slack)

    def epsilon(self, target_delta: float) -> float:
        room = target_delta - self.slack
        if not room >= 0.5 * target_delta:
            raise UnsupportedEventError(
                f"privkit's PLD: delta {target_delta:g} is below twice its floating-point "
                "allowance")
        eps = max(_epsilon_of(c, room - c.wrap_bound) for c in self._comps)
        for i in range(64):  # rounding: verify with delta() itself, move up by ulps if needed
            if self.delta(eps) <= target_delta:
                return eps
            eps += abs(eps) * 2.0 ** (i - 52) + 5e-324
        raise NumericalError(f"privkit's PLD: epsilon {eps} did not verify")


class WindowTooLarge(ValueError):
    """The composition does not fit :data:`MAX_POINTS` on the requested grid."""


def curve(atoms: list[tuple[Any, int]], relation: str, h: float, *,
          extended: bool = False, tail: float = 1e-30) -> Curve:
    """The composition on the grid ``h`` exactly, in one stage (no re-discretisation): exact up
    to the FFT allowance for pure steps whose epsilons are multiples of ``h``.

    Raises:
        WindowTooLarge: the window would exceed :data:`MAX_POINTS` points.
    """
    steps = _steps(atoms)
    try:
        comps = [_compose(_pmfs(atoms, d, h, tail), h, tail, extended)
                 for d in _directions(atoms, relation)]
    except _TooFine as exc:
        raise WindowTooLarge(f"{exc.n} grid points at interval {h:g}") from None
    return Curve(comps, SLACK_PER_FACTOR[extended] * steps)


def _steps(atoms: list[tuple[Any, int]]) -> int:
    return sum(n for _, n in atoms)


def epsilon(atoms: list[tuple[Any, int]], target_delta: float, relation: str,
            eps_estimate: float | None = None) -> tuple[float, float]:
    """(epsilon, coarse grid interval) at ``target_delta``: an upper bound (module doc).

    Raises:
        UnsupportedEventError: the floating-point allowance leaves no room below
            ``target_delta``, or a step's loss is too large for a grid.
    """
    out, h, _ = epsilon_above(atoms, target_delta, relation, None, eps_estimate)
    return out, h


def epsilon_above(atoms: list[tuple[Any, int]], target_delta: float, relation: str,
                  bound: float | None, eps_estimate: float | None = None
                  ) -> tuple[float, float, bool]:
    """As :func:`epsilon`, but it may stop early once the answer is known to exceed
    ``bound``: ``(epsilon, interval, True)``, or ``(e, interval, False)`` with ``bound < e <=
    epsilon`` (one direction's epsilon, when the other was not priced). A calibration that
    only needs to know that a point is over its target saves half the work."""
    if eps_estimate is None:
        eps_estimate = estimate(atoms, target_delta)
    budget = _TAIL_SHARE * target_delta
    out, h, whole = _epsilon_at(atoms, target_delta, relation,
                                plan(atoms, eps_estimate, target_delta), budget, bound)
    if 0 < out < 0.5 * eps_estimate:
        # The estimate was far too high, so the grid was coarser than the target needs:
        # once more on the grid planned for the answer (any grid gives an upper bound).
        again, h2, _ = _epsilon_at(atoms, target_delta, relation,
                                   plan(atoms, 1.1 * out, target_delta), budget, None)
        if not whole:  # the first answer was one direction's only
            out, h, whole = _epsilon_at(atoms, target_delta, relation,
                                        plan(atoms, eps_estimate, target_delta), budget, None)
        if again < out:
            out, h = again, h2
    return out, h, whole


def _epsilon_at(atoms: list[tuple[Any, int]], target_delta: float, relation: str, p: _Plan,
                budget: float, bound: float | None = None) -> tuple[float, float, bool]:
    """(epsilon, coarse interval, whole): the directions are priced one by one (the first
    usually the larger), stopping once one exceeds ``bound`` (whole False)."""
    while True:
        prec = _precision(atoms, p, target_delta)
        room = target_delta - prec.slack
        if not room > 0.5 * target_delta:
            raise UnsupportedEventError(
                f"privkit's PLD: delta {target_delta:g} is below twice its floating-point "
                f"allowance over {_steps(atoms)} steps")
        out, h = 0.0, p.coarse
        try:
            for d in _directions(atoms, relation):
                comp = _composed(atoms, d, p, prec, budget, budget)
                out, h = max(out, _epsilon_of(comp, room - comp.wrap_bound)), comp.h
                if bound is not None and out > bound:
                    return out, h, False
            return out, h, True
        except _TooFine as exc:
            grow = 1.05 * exc.n / MAX_POINTS
            p = _Plan(p.fine * grow, p.coarse * grow, p.block)


def delta(atoms: list[tuple[Any, int]], eps: float, relation: str, eps_estimate: float,
          delta_estimate: float) -> float:
    """Upper bound on delta at ``eps`` (tails budgeted against ``delta_estimate``; when the
    answer comes out so small that double precision's allowance would matter, it is computed
    again in extended precision)."""
    target = max(min(delta_estimate, 0.5), 1e-300)
    for _ in range(2):
        # delta_estimate may be far above the answer (RDP's): tails get a much smaller share.
        budget = max(1e-9 * min(target, 1.0), 1e-300)
        p = plan(atoms, max(eps_estimate, eps), target)
        comps, slack = _priced(atoms, relation, p, target, budget, budget)
        worst = min(1.0, max(_hockey(c, eps) + c.wrap_bound for c in comps) + slack)
        if slack <= _EXTENDED_ABOVE * worst or worst >= target:
            return worst
        target = max(worst, 1e-300)
    return worst
