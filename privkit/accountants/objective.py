"""Objective perturbation (Upcycled-FL Thm C.2) and the L2-norm Laplace: per-step epsilon and rules.

One objective-perturbation step solves ``argmin_w F_i(w) + (mu/2)||w - w_bar||^2 + <n, w>``
with ``p(n) ~ exp(-alpha ||n||_2)``. Under Thm C.2's conditions it is pure
epsilon-DP with (Yin et al., arXiv 2310.06341, Appendix C, Thm C.2)::

    epsilon = 2 alpha u1 / |D|  +  1.4 r u2 / (|D| mu),       u2 <= 0.5 |D| mu,

where the first term bounds the density ratio of ``n`` and the second the
Jacobian ratio ``|det(I + A^-1 A_Delta)|^-1 <= (1 - u2/(|D| mu))^-r``, with
``-ln(1 - x) < 1.4 x`` on [0, 0.5]. ``r`` is the rank of ``A_Delta``: 2 for the
paper's binary GLM (its 2.8 = 1.4 * 2), up to 2(K-1) for K-class softmax.

This module also registers the accounting rules of
:class:`~privkit.events.L2LaplaceDpEvent` and
:class:`~privkit.events.ObjectivePerturbationDpEvent` (it is imported by
:mod:`privkit.accountants`, so the rules exist whenever accountants do):

* ``pure_epsilon``: the event's epsilon (optimal / basic / advanced composition).
* ``rdp_curve`` and ``pld_of``: randomized response RR(epsilon), which dominates
  every epsilon-DP mechanism; except ``L2LaplaceDpEvent`` with ``dimension == 1``,
  which is the 1-D Laplace mechanism and gets dp-accounting's exact Laplace PLD
  with parameter 1/epsilon.
* ``notes``: the assumptions each report must state; an unproven
  objective-perturbation step adds a line starting with ``"NOT PROVEN:"``.

Example:
    >>> round(objective_step_epsilon(alpha=20, lipschitz=1, smoothness=0.25, rank=2,
    ...                              dataset_size=224, proximal_mu=0.1), 6)
    0.209821
"""

from __future__ import annotations

from typing import Any

import numpy as np

from privkit.accountants import rules
from privkit.accountants._atoms import PureAtom
from privkit.accountants.rules import pld_lib
from privkit.events import (
    JACOBIAN_CONSTANT,
    L2LaplaceDpEvent,
    ObjectivePerturbationDpEvent,
    objective_step_epsilon,
)

__all__ = ["objective_step_epsilon", "JACOBIAN_CONSTANT"]

# --------------------------------------------------------------- rules
@rules.pure_epsilon.register
def _(event: L2LaplaceDpEvent) -> float | None:
    return float(event.epsilon)


@rules.pure_epsilon.register
def _(event: ObjectivePerturbationDpEvent) -> float | None:
    return float(event.epsilon)


@rules.rdp_curve.register
def _(event: L2LaplaceDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    return rules.randomized_response_rdp(event.epsilon, orders)


@rules.rdp_curve.register
def _(event: ObjectivePerturbationDpEvent, orders: np.ndarray, relation: Any) -> np.ndarray:
    return rules.randomized_response_rdp(event.epsilon, orders)


@rules.pld_of.register
def _(event: L2LaplaceDpEvent, vdi: float, relation: Any) -> Any:
    if int(event.dimension) == 1:
        # d = 1 is the Laplace mechanism with scale Delta/epsilon: the pair
        # Lap(0, 1/eps) vs Lap(1, 1/eps) in sensitivity units, exactly. The
        # relation is the one Delta was computed for (the event is unsampled),
        # so it does not change the pair.
        return pld_lib.from_laplace_mechanism(
            parameter=1.0 / float(event.epsilon), value_discretization_interval=vdi,
            pessimistic_estimate=True,
        )
    return rules.randomized_response_pld(event.epsilon, vdi)


@rules.pld_of.register
def _(event: ObjectivePerturbationDpEvent, vdi: float, relation: Any) -> Any:
    return rules.randomized_response_pld(event.epsilon, vdi)


@rules.notes.register
def _(event: L2LaplaceDpEvent) -> tuple[str, ...]:
    return ("each L2LaplaceDpEvent step is epsilon-DP for the L2 sensitivity it was "
            "calibrated to (d > 1: dominated by randomized response)",)


@rules.notes.register
def _(event: ObjectivePerturbationDpEvent) -> tuple[str, ...]:
    thm = ("objective perturbation (Upcycled-FL Thm C.2): GLM with convex per-example loss, "
           "||grad|| < u1, |loss''| <= u2, feature norm <= 1, u2 <= 0.5 |D| mu, exact argmin")
    if event.proven:
        return (thm,)
    return (thm, "NOT PROVEN: an objective-perturbation step ran outside Thm C.2 "
                 "(non-GLM model or inexact solver); its epsilon is the theorem's formula "
                 "applied where the proof does not hold")


@rules.only_known_as_pure.register
def _(event: ObjectivePerturbationDpEvent) -> bool:
    return True


@rules.fft_atom.register
def _(event: ObjectivePerturbationDpEvent) -> Any:
    return PureAtom(float(event.epsilon))


@rules.fft_atom.register
def _(event: L2LaplaceDpEvent) -> Any:
    # d = 1 is the 1-D Laplace, priced with its own (tighter) PLD by dp-accounting instead.
    return PureAtom(float(event.epsilon)) if int(event.dimension) > 1 else None


# Both state their guarantee ("epsilon-DP under the relation the sensitivity was computed
# for", the relation they are priced with): nothing to re-express (rules module doc).
rules.relative_to_sensitivity.register(L2LaplaceDpEvent, rules.guarantee_event)
rules.relative_to_sensitivity.register(ObjectivePerturbationDpEvent, rules.guarantee_event)


@rules.only_known_as_pure.register
def _(event: L2LaplaceDpEvent) -> bool:
    return int(event.dimension) > 1  # d = 1 is the 1-D Laplace: its own PLD is tighter
