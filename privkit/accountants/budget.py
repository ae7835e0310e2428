"""Per-client compositions for a budget ledger, and budget checks that never re-price the
whole history every round.

A ledger charges a few distinct events to many clients over many rounds. :class:`States`
keeps every distinct composition once (a *state*: client histories that are equal share it),
moves a client from state to state by the composition a charge adds (memoised), and answers
two questions about states:

* :meth:`States.prices`: the **tight** epsilon of each state under the ledger's method, the
  number reports show. It is computed once per state, and only when asked for.
* :meth:`States.within_budget`: would each new state stay within the budget, that is, is its
  tight epsilon at most the budget? The answer is the same as pricing the new state, but it
  is reached without pricing it whenever a cheaper argument settles it:

  1. **Cheap methods** (``exact``, ``moments``, ``basic``, ``advanced``, ``rdp``, and ``auto``
     on compositions of unsampled Gaussians, which it prices exactly in closed form) are
     simply priced: their cost does not grow with the history.
  2. **A valid upper bound far below the budget**: the state's RDP bound (Balle et al. 2020
     conversion), updated by adding the charged event's RDP curve to the previous state's
     (cached per event: O(number of orders) per charge), or a *covering* state, a
     composition that contains the new one (every atom at least as often) and whose tight
     epsilon was found to be within the budget. Epsilon only grows when events are added, so
     both bound the new state's epsilon. They settle the question when they are at most
     ``(1 - MARGIN)`` times the budget. Every accepted charge then has a valid upper bound
     within the budget; and the tight price P, an upper bound at most a relative ``e`` above
     the exact epsilon, is at most ``(1 + e)`` times any valid bound, so it is within the
     budget too while ``e <= MARGIN / (1 - MARGIN)``, about 1e-4: privkit's PLD is planned for
     ``e`` of 5e-6 (:data:`privkit.accountants.fftpld.RELATIVE_ERROR`) and the exact values
     and optimal pure composition are closer, so a bound that far below the budget cannot
     hide a tight price above it. Where the tight price may be dp-accounting's PLD, which
     ``auto`` lets err by a modelled 2e-4, the margin is ``LOOSE_MARGIN`` (1e-3).
  3. **Near the budget** (a state whose bounds are above ``(1 - MARGIN)`` times the budget),
     one look ahead is priced: the new state plus ``k`` more uses of the charged event
     (``k`` the number of uses already there at first, then doubled while it passes, and cut
     to an estimate of the remaining room when it fails). When its tight epsilon is within
     ``(1 - MARGIN)`` of the budget it covers the next ``k`` charges; otherwise the new state
     itself is priced, which decides exactly. Within ``MARGIN`` of the budget (the last ~0.02%
     of a run that ends at its budget, when epsilon grows like the square root of the number
     of charges, and at least the charge that is refused) every new state is priced.

So a charge costs O(1) amortised: no pricing at all far from the budget, O(log T) pricings
on the way to it, and tight pricing only in the last stretch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from privkit.accountants import rdp, rules
from privkit.accountants._methods import (
    Method,
    _fft_atoms,
    _rdp_total,
    _rho_total,
    unsupported,
)
from privkit.accountants.accountant import epsilon_batch_compositions
from privkit.accountants.rules import Composition
from privkit.errors import NumericalError, PrivkitError, UnsupportedEventError

__all__ = ["MARGIN", "LOOSE_MARGIN", "States"]

#: A bound (or a covering state's tight epsilon) decides "within budget" only when it is at
#: most ``(1 - MARGIN)`` times the budget (module doc), when the tight price is privkit's PLD,
#: an exact value or optimal composition; ``LOOSE_MARGIN`` when it may be dp-accounting's PLD
#: (``auto`` allows that one a modelled 2e-4 of discretisation error).
MARGIN = 1e-4
LOOSE_MARGIN = 1e-3
_EMPTY = Composition(())
_CHEAP = frozenset({Method.EXACT, Method.MOMENTS, Method.BASIC, Method.ADVANCED, Method.RDP})


class States:
    """Interned compositions (state 0 is the empty one) and their prices (module doc).

    Args:
        delta: the delta of every epsilon.
        method: the accounting method of the tight prices.
        relation: dp-accounting's neighbouring relation. The states hold the charged events
            as given; each is re-expressed against the relation's sensitivity only when it is
            priced (:func:`privkit.accountants.rules.priced`).
        budget: the per-client epsilon budget; None: no budget (nothing is ever priced
            unless :meth:`prices` is asked).
    """

    def __init__(self, delta: float, method: Method, relation: Any,
                 budget: float | None) -> None:
        self.delta, self.method, self.relation, self.budget = delta, method, relation, budget
        self.comps: list[Composition] = [_EMPTY]
        self._ids: dict[Composition, int] = {_EMPTY: 0}
        self._trans: dict[tuple[int, int], int] = {}
        self.deltas: list[Composition] = []
        self._eps: dict[int, float] = {0: 0.0}  # tight prices
        self._ok: dict[int, bool] = {0: True}  # within the budget, decided
        self._cover: dict[int, int] = {}  # state -> a covering state within the budget
        self._hint: dict[int, int] = {}  # state -> look-ahead multiple to try next (0: none)
        self._rdp: dict[int, np.ndarray | None] = {0: np.zeros_like(rdp.ORDERS)}
        self._delta_rdp: dict[int, np.ndarray | None] = {}
        self._counts: dict[int, dict[Any, int]] = {}
        self.priced = 0
        """How many compositions have been priced tightly (for benchmarks and tests)."""

    # ------------------------------------------------------------ states
    def add_delta(self, comp: Composition, *, check: bool = True) -> int:
        """Register what one charge adds; returns its delta id.

        With ``check``, refuses a composition the method has no rule for (by the event types:
        nothing is priced).

        Raises:
            UnsupportedEventError: the method cannot price ``comp``.
        """
        if check:
            why = unsupported(comp, self.method, self.relation)
            if why is not None:
                raise UnsupportedEventError(why)
        self.deltas.append(comp)
        return len(self.deltas) - 1

    def state_of(self, comp: Composition) -> int:
        """The state id of ``comp`` (interned)."""
        sid = self._ids.setdefault(comp, len(self.comps))
        if sid == len(self.comps):
            self.comps.append(comp)
        return sid

    def next(self, state: int, delta_id: int) -> int:
        """The state after ``state`` is charged ``delta_id`` (memoised)."""
        nxt = self._trans.get((state, delta_id))
        if nxt is None:
            nxt = self.state_of(self.comps[state] + self.deltas[delta_id])
            self._trans[(state, delta_id)] = nxt
        return nxt

    # ------------------------------------------------------------ prices
    def known(self, state: int) -> float | None:
        """The tight price of ``state`` if it has been computed or needs no accountant
        (inf for a non-private composition); None otherwise (never prices)."""
        if self.comps[state].non_private:
            return math.inf
        return self._eps.get(state)

    def prices(self, states: Sequence[int]) -> np.ndarray:
        """Tight epsilons of ``states`` under the method (each state priced once)."""
        missing = list({s for s in states if s not in self._eps})
        if missing:
            eps = epsilon_batch_compositions([self.comps[s] for s in missing], self.delta,
                                             self.method, self.relation)
            self.priced += len(missing)
            self._eps.update(zip(missing, eps.tolist(), strict=True))
        return np.fromiter((self._eps[s] for s in states), dtype=np.float64, count=len(states))

    def _price(self, state: int) -> float:
        return float(self.prices([state])[0])

    # ------------------------------------------------------------ budget
    def within_budget(self, before: Sequence[int], delta_id: int,
                      after: Sequence[int]) -> np.ndarray:
        """Bool per client: is the tight epsilon of ``after[i]`` (``before[i]`` charged
        ``delta_id``) at most the budget? All True without a budget.

        Raises:
            UnsupportedEventError: the method cannot price a state it had to price.
        """
        budget = self.budget
        out = np.ones(len(after), dtype=bool)
        if budget is None:
            return out
        for i, (b, s) in enumerate(zip(before, after, strict=True)):
            ok = self._ok.get(s)
            if ok is None:
                ok = self._ok[s] = self._decide(b, delta_id, s, budget)
            out[i] = ok
        return out

    def _decide(self, before: int, did: int, state: int, budget: float) -> bool:
        comp = self.comps[state]
        if comp.non_private:
            return False
        if state in self._eps or self._cheap(comp):
            return self._price(state) <= budget
        far = budget * (1 - self._margin(comp))
        cover = self._cover.get(before)
        if cover is not None and self._contains(cover, comp):
            self._cover[state] = cover
            return True
        bound = self._rdp_epsilon(before, did, state)
        if bound is not None and bound <= far:
            return True
        return self._near(before, did, state, budget, far)

    def _near(self, before: int, did: int, state: int, budget: float, far: float) -> bool:
        """Near the budget: price one look-ahead state; if it is not within ``far``, price
        the new state itself (module doc, step 3)."""
        comp, step = self.comps[state], self.deltas[did]
        k = self._hint.get(before)
        if k is None:
            counts = self._atom_counts(state)
            k = max(1, min(counts[a] // n for a, n in step.atoms)) if step.atoms else 0
        ahead, e_ahead = None, math.inf
        if k > 0:
            more = Composition(tuple((a, n * k) for a, n in step.atoms), step.non_private)
            ahead = self.state_of(comp + more)
            e_ahead = self._price(ahead)
            if e_ahead <= far:
                self._cover[state] = ahead
                self._hint[state] = 2 * k
                return True
        e = self._price(state)
        if ahead is not None and e <= far and e_ahead > e:
            # room left, by linear interpolation from here to the look-ahead (epsilon is
            # concave in the count, so this overshoots a little: halved)
            self._hint[state] = max(1, int(k * (far - e) / (e_ahead - e) / 2))
        else:
            self._hint[state] = 0 if e > far else 1
        return e <= budget

    def _margin(self, comp: Composition) -> float:
        if self.method is Method.PLD or (self.method is Method.AUTO
                                         and _fft_atoms(comp) is None):
            return LOOSE_MARGIN
        return MARGIN

    def _cheap(self, comp: Composition) -> bool:
        if self.method in _CHEAP:
            return True
        return self.method is Method.AUTO and _rho_total(comp) is not None

    def _atom_counts(self, state: int) -> dict[Any, int]:
        counts = self._counts.get(state)
        if counts is None:
            counts = self._counts[state] = dict(self.comps[state].atoms)
        return counts

    def _contains(self, big: int, comp: Composition) -> bool:
        """Whether the state ``big`` holds every atom of ``comp`` at least as often."""
        if comp.non_private and not self.comps[big].non_private:
            return False
        counts = self._atom_counts(big)
        return all(counts.get(a, 0) >= n for a, n in comp.atoms)

    def _rdp_epsilon(self, before: int, did: int, state: int) -> float | None:
        """The RDP bound on the state's epsilon (the previous state's curve plus the
        charge's), or None when an atom has no RDP rule."""
        curve = self._rdp.get(state, _UNSET)
        if curve is _UNSET:
            prev = self._rdp.get(before, _UNSET)
            if prev is _UNSET:  # reached by another path first: from scratch, once
                prev = self._curve_of(self.comps[before])
            add = self._delta_rdp.get(did, _UNSET)
            if add is _UNSET:
                add = self._delta_rdp[did] = self._curve_of(self.deltas[did])
            curve = None if prev is None or add is None else prev + add
            self._rdp[state] = curve
        if curve is None:
            return None
        try:
            return rdp.epsilon_from_rdp(rdp.ORDERS, curve, self.delta)[0]
        except NumericalError:
            return None

    def _curve_of(self, comp: Composition) -> np.ndarray | None:
        try:
            return _rdp_total(*rules.priced(comp, self.relation))
        except PrivkitError:
            return None


_UNSET: Any = object()
