"""Pricing matrix-factorization (banded MF, tree DP-FTRL) runs: sensitivity and events.

A run of :class:`privkit.mechanisms.BandMF` releases ``C^-1 (C x + Z)`` with ``Z`` i.i.d.
``N(0, (z C_clip)^2)``: a post-processing of one Gaussian mechanism ``C x + Z`` whose inputs
may be chosen adaptively (Denisov et al., NeurIPS 2022; several participations:
Choquette-Choo et al., ICML 2023). One client contributes rows
``g_t`` (``||g_t|| <= C_clip``) in the rounds it takes part in, so in units of ``C_clip`` the
L2 sensitivity under add/remove-one-client is

    sens^2 = max_pi max_g ||sum_{t in pi} C[:, t] g_t^T||_F^2
           = max_pi max_g sum_{i, j in pi} X_ij <g_i, g_j>,     X = C^T C,

over the participation patterns pi the schema allows and unit vectors g,

and the run is ``GaussianDpEvent(z / sens)``, composed once, under every relation (the
accountant doubles the sensitivity under replace-one). Zero-out (``REPLACE_SPECIAL``: a
client's data replaced by a null contribution, the client staying in its rounds) has the same
sensitivity as add/remove, and it is the relation a fixed schedule satisfies: a server that
fixes the population and each round's cohort size cannot promise that adding a client moves
nobody else. :func:`bandmf_sensitivity` computes ``sens`` for the participation schemas below,
never below the true maximum:

- **exact, closed form**, for a banded Toeplitz ``C`` when participations are at least ``b``
  rounds apart (columns of different rounds have disjoint supports: ``X`` restricted to a
  pattern is diagonal), or when its coefficients are non-negative and non-increasing (then
  ``X >= 0`` entrywise, ``X_ij`` shrinks as ``|i - j|`` grows and as the pair moves right, so
  the pattern ``0, s, 2s, ...`` dominates every other term by term);
- **exact**, for any ``C``, when the separation is at least ``C``'s bandwidth (a DP over the
  column norms);
- otherwise an **upper bound** (Choquette-Choo et al., NeurIPS 2023, Algorithm 4, with the
  row stage restricted to patterns through the row): ``|X|`` replaces ``X``, each row's best
  pattern through it is found by a DP, and the best pattern of those row values by another.

**Amplified variant** (:class:`CyclicPoisson`): the population is split into ``g >= b``
fixed groups, round ``t`` serves group ``t mod g`` and takes each of its clients independently
with probability ``q`` (secret). A client's rounds are then ``g >= b`` apart, so the rows each
of them moves are disjoint blocks of ``b`` rows; each block is one Poisson-subsampled Gaussian
release of the same ``g_t`` with sensitivity ``||C[:, t]||``, and the blocks compose
adaptively: the run is dominated by
``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z / zeta)), ceil(T / g))``
with ``zeta`` the largest column norm (Choquette-Choo et al., NeurIPS 2023, amplification for
banded MF; ``docs/theory/banded_mf.md`` has the argument and its assumptions).

Every event is dp-accounting's own, so :func:`privkit.epsilon` and dp-accounting's accountants
both price it. :func:`bandmf_assumptions` states what the number assumes.

Example:
    >>> import privkit
    >>> ev = bandmf_event((1.0,), noise_multiplier=1.0, rounds=100,
    ...                   participation=MinSeparation(20, 5))   # identity: DP-FedAvg
    >>> ev, round(privkit.epsilon(ev, 1e-5).epsilon, 2)
    (GaussianDpEvent(noise_multiplier=0.4472135954999579), 11.48)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.accountants._bandmf_participation import (
    Cyclic,
    CyclicPoisson,
    MinSeparation,
    _schema,
    _spacing,
)
from privkit.accountants._bandmf_sensitivity import (
    BandMFSensitivity,
    _sensitivity,
    _Strategy,
    _strategy,
    _uniform,
    bandmf_sensitivity,
)
from privkit.accountants._relations import sensitivity_factor
from privkit.accountants.accountant import epsilon
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError, NumericalError
from privkit.events import (
    DpEvent,
    GaussianDpEvent,
    NoOpDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
)
from privkit.events.mechanisms import as_relation

__all__ = [
    "BandMFCalibration",
    "BandMFSensitivity",
    "Cyclic",
    "CyclicPoisson",
    "MinSeparation",
    "bandmf_assumptions",
    "bandmf_event",
    "bandmf_round_events",
    "bandmf_sensitivity",
    "calibrate_bandmf",
]

# ------------------------------------------------------------------ events
def _noise(noise_multiplier: Any) -> float:
    return _validate.positive("noise_multiplier", noise_multiplier)


def _amplified(st: _Strategy, schema: CyclicPoisson) -> tuple[float, int]:
    """(largest column norm, blocks per client) of the amplified schema."""
    g = int(schema.groups)
    if g < st.bandwidth:
        raise InvalidParameterError("groups", g, f">= the strategy's bandwidth "
                                    f"({st.bandwidth}) for the amplified analysis")
    if st.dense is not None:
        zeta2 = float(np.max(np.sum(st.dense * st.dense, axis=0)))
    else:
        assert st.coefficients is not None
        zeta2 = float(np.dot(st.coefficients, st.coefficients))
    return math.sqrt(zeta2), -(-st.rounds // g)


@dataclass(frozen=True)
class _Priced:
    """What an event needs besides the noise: a whole-run sensitivity, or the amplified
    schema's column norm, blocks and sampling rate."""

    sensitivity: float
    blocks: int = 0
    sampling_probability: float = 1.0

    def block_event(self, z: float) -> DpEvent:
        """The Gaussian of the whole run, or (amplified) of one block, subsampled: its noise
        multiplier is relative to the bound on one client's contribution per round (the
        accountant doubles it under ``REPLACE_ONE``)."""
        inner = GaussianDpEvent(z / self.sensitivity)
        q = self.sampling_probability
        return inner if q == 1 else PoissonSampledDpEvent(q, inner)

    def event(self, z: float) -> DpEvent:
        one = self.block_event(z)
        return SelfComposedDpEvent(one, self.blocks) if self.blocks else one


def _priced(strategy: Any, rounds: Any, participation: Any) -> tuple[_Priced, _Strategy, Any]:
    t = _validate.positive_int("rounds", rounds)
    schema = _schema(participation)
    st = _strategy(strategy, t)
    if isinstance(schema, CyclicPoisson):
        zeta, blocks = _amplified(st, schema)
        return _Priced(zeta, blocks, float(schema.sampling_probability)), st, schema
    sens = _sensitivity(st, schema)
    if not sens.value > 0:
        raise NumericalError(f"sensitivity came out as {sens.value}")
    return _Priced(sens.value), st, schema


def bandmf_event(strategy: Any, *, noise_multiplier: float, rounds: int, participation: Any,
                 neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE) -> DpEvent:
    """The event of a whole run (JAX-Privacy style pure builder).

    ``MinSeparation`` / ``Cyclic``: ``GaussianDpEvent(z / sens)``, composed once.
    ``CyclicPoisson``:
    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z / zeta)), ceil(T / g))``
    with ``zeta`` the largest column norm (``q = 1``: no sampling event). The event is the
    same under every relation (noise over the bound on one contribution); price it under the
    relation the schedule satisfies: a schedule that fixes the population and the cohort size
    (``MinSeparation`` with a fixed number per round, ``Cyclic``) satisfies zero-out
    (``REPLACE_SPECIAL``) and ``REPLACE_ONE``, not add/remove (an added client could push
    another out of a round).

    Args:
        strategy: as for :func:`bandmf_sensitivity`.
        noise_multiplier: the mechanism's z (stddev of ``Z`` / clip norm), finite, > 0.
        rounds: T, the rounds the run releases.
        participation: :class:`MinSeparation`, :class:`Cyclic` or :class:`CyclicPoisson`.
        neighboring_relation: the relation it will be priced under (validated; any of
            ``ADD_OR_REMOVE_ONE``, ``REPLACE_SPECIAL``, ``REPLACE_ONE``).
    """
    z = _noise(noise_multiplier)
    as_relation(neighboring_relation)
    return _priced(strategy, rounds, participation)[0].event(z)


def bandmf_round_events(strategy: Any, *, noise_multiplier: float, rounds: int,
                        participation: Any,
                        neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE
                        ) -> tuple[DpEvent, ...]:
    """One event per round whose composition is priced exactly as :func:`bandmf_event`, to
    charge on a ledger before each round's noise (``NoOpDpEvent`` rounds charge nothing).

    Where the sensitivity is exact through the uniform pattern (banded Toeplitz, rounds at
    least b apart or monotone coefficients), round ``r``'s event is the Gaussian whose
    ``1 / z_r^2`` is what row ``r`` adds to ``sens^2 / z^2``: the first ``r + 1`` charges then
    price exactly the first ``r + 1`` releases. ``CyclicPoisson``: the amplified block event
    in rounds ``0, g, 2g, ...`` (every group's ``m``-th block starts no earlier). Otherwise the
    whole run's event in round 0.
    """
    z = _noise(noise_multiplier)
    as_relation(neighboring_relation)
    priced, st, schema = _priced(strategy, rounds, participation)
    t = st.rounds
    noop: DpEvent = NoOpDpEvent()
    if isinstance(schema, CyclicPoisson):
        one = priced.block_event(z)
        return tuple(one if r % int(schema.groups) == 0 else noop for r in range(t))
    s, k = _spacing(schema, t)
    if st.coefficients is None or not (s >= st.bandwidth or st.monotone):
        return (priced.event(z),) + (noop,) * (t - 1)
    c = st.coefficients
    rows = np.zeros(t)
    for start in _uniform(t, s, k):  # row r of C 1_pi: the uniform pattern's entries
        stop = min(t, start + c.size)
        rows[start:stop] += c[: stop - start]
    return tuple(GaussianDpEvent(z / abs(v)) if v != 0 else noop for v in rows)


# ------------------------------------------------------------------ assumptions
def bandmf_assumptions(participation: Any,
                       neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE
                       ) -> tuple[str, ...]:
    """What a banded-MF epsilon assumes, one phrase each (reports print them).

    Example:
        >>> for line in bandmf_assumptions(MinSeparation(10, 3))[1:3]:
        ...     print(line[:76])
        participation enforced by the server: at most 3 rounds per client, any two a
        updates may depend on earlier releases (adaptive streams), never on who else
    """
    schema = _schema(participation)
    rel = as_relation(neighboring_relation)
    out = ["trusted aggregator: it clips, sums and adds the correlated noise itself and keeps "
           "the noise state secret (privkit.mechanisms.BANDMF_TRUST_ASSUMPTION)"]
    if isinstance(schema, MinSeparation):
        out.append(f"participation enforced by the server: at most "
                   f"{schema.max_participations} rounds per client, any two at least "
                   f"{schema.min_separation} rounds apart; the server knows who took part "
                   "(no amplification: the epsilon holds against it)")
    else:
        out.append(f"clients split into {schema.groups} fixed groups before training, "
                   f"independently of the data; round t serves group t mod {schema.groups}")
    if isinstance(schema, CyclicPoisson):
        out.append(f"within the round's group each client takes part independently with "
                   f"probability {schema.sampling_probability}, and who took part stays "
                   "secret (amplification used; against the server that draws the sample, "
                   "the Cyclic schema's unamplified epsilon holds)")
    elif isinstance(schema, Cyclic):
        out.append("the server may pick any subset of the round's group (no amplification)")
    out.append("updates may depend on earlier releases (adaptive streams), never on who "
               "else took part")
    out.append("neighbouring relation: " + {
        "ADD_OR_REMOVE_ONE": "add or remove one client with all its rounds",
        "REPLACE_SPECIAL": "zero-out: one client's data replaced by a null contribution in "
                           "the same rounds (the population and the schedule are public and "
                           "never depend on the data)",
        "REPLACE_ONE": "replace one client's data by another's in the same rounds "
                       "(sensitivity twice the clip norm per participation)"}[rel.name])
    return tuple(out)


# ------------------------------------------------------------------ calibration
@dataclass(frozen=True)
class BandMFCalibration:
    """A calibrated noise multiplier for a banded-MF run, and what it was verified at.

    ``noise_multiplier`` is the mechanism's z (stddev of ``Z`` / clip norm); ``event`` is
    :func:`bandmf_event` at it, whose epsilon (``epsilon``, by ``method``) is <= the target.
    ``sensitivity`` is the whole-run sensitivity (or, for ``CyclicPoisson``, the largest
    column norm the blocks are priced with).
    """

    noise_multiplier: float
    epsilon: float
    delta: float
    method: str
    target_epsilon: float
    sensitivity: float
    event: DpEvent


def calibrate_bandmf(strategy: Any, *, target_epsilon: float, delta: float, rounds: int,
                     participation: Any,
                     neighboring_relation: Any = NeighboringRelation.ADD_OR_REMOVE_ONE,
                     tol: float = 1e-6) -> BandMFCalibration:
    """The smallest noise multiplier (to relative ``tol``, on the safe side) whose run meets
    ``target_epsilon`` at ``delta``, by :func:`privkit.calibrate_noise` on
    :func:`bandmf_event` (exact Gaussian pricing, or privkit's PLD for ``CyclicPoisson``).

    Example:
        >>> r = calibrate_bandmf((1.0,), target_epsilon=2.0, delta=1e-5, rounds=100,
        ...                      participation=MinSeparation(10, 10))
        >>> round(r.noise_multiplier, 4), r.epsilon <= 2.0, r.method
        (6.305, True, 'exact')
    """
    from privkit.accountants.calibration import calibrate_noise

    target = _validate.positive("target_epsilon", target_epsilon)
    d = _validate.delta("delta", delta)
    rel = as_relation(neighboring_relation)
    priced = _priced(strategy, rounds, participation)[0]
    # replacing a client moves each row by up to 2 C: the accountant applies it to the
    # events, here it only scales the calibration's first guess
    guess = priced.sensitivity * sensitivity_factor(rel)
    z, eps, method = calibrate_noise(priced.event, target_epsilon=target,
                                     delta=d, tol=tol, initial_guess=guess,
                                     neighboring_relation=rel)
    event = priced.event(z)
    check = epsilon(event, d, neighboring_relation=rel)
    if check.epsilon > target:  # cannot happen: the same event was priced; guard anyway
        raise NumericalError("calibration failed to verify its answer")
    return BandMFCalibration(z, eps, d, method, target, priced.sensitivity, event)
