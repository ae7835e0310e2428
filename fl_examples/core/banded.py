"""Client-level DP without (or with) Poisson sampling: banded matrix factorization in the
synchronous trainers (``--privacy client --mechanism bandmf``).

Every data round the server takes a cohort under a participation schema, clips each
update to C, sums, and adds round ``t``'s correlated noise from
:class:`privkit.mechanisms.BandMF` (the last b - 1 noise draws are the state, checkpointed
and never published); the noisy sum is divided by a public cohort size and applied with the
server optimiser. The ledger holds one id, ``population`` (every client's guarantee is the
same), charged each round the event :func:`privkit.accountants.bandmf_round_events` gives
before the round's noise is drawn; the charges compose to :func:`bandmf_event`.

Participation (``--participation``):

* ``minsep``: a cohort of ``m = round(q N)`` clients drawn uniformly each round among those
  that did not take part in the last ``s - 1`` data rounds (s-min-separation, s = b by
  default); a client can then take part at most ``ceil(T / s)`` times. The server knows who
  took part: **no amplification**. A round with fewer eligible clients than ``m`` takes them
  all (counted in the report as a shortfall); the divisor stays ``m``. A fixed cohort size
  means an added client can push another out of a round (and, with s > 1, move its later
  rounds), so this schema is priced under **zero-out** (dp-accounting's ``REPLACE_SPECIAL``:
  a client's data replaced by a null contribution, the client keeping its rounds), which it
  satisfies: the population and the schedule are public and never depend on the data. The
  report gives replace-one beside it.
* ``cyclic``: clients split by id into ``g`` groups (``c mod g``, fixed before training);
  data round ``t`` serves every client of group ``(t - 1) mod g``. No amplification.
* ``poisson``: the cyclic groups, and within the round's group each client independently with
  probability q, the outcome secret: amplified (:class:`CyclicPoisson`); needs ``g >= b``.

b = 1 (``--bands 1``) is DP-FedAvg's independent noise under the same participation
(``--min-separation s`` or ``--groups g``), priced without amplification for
``minsep``/``cyclic``: the fair baseline.

The data round index is the band's time axis: Upcycled-FL's even iterations touch no data,
release nothing new about it, and do not advance the noise state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import privkit
from fl_examples.core.dp_modes import (
    POPULATION,
    check_client_settings,
    epsilon_section,
    server_step,
)
from fl_examples.core.rounds import client_uniforms
from fl_examples.core.seeds import SeedTree
from privkit import _validate
from privkit.accountants.bandmf import (
    Cyclic,
    CyclicPoisson,
    MinSeparation,
    bandmf_assumptions,
    bandmf_event,
    bandmf_round_events,
    bandmf_sensitivity,
    calibrate_bandmf,
)
from privkit.errors import InvalidParameterError
from privkit.events import NOISE_MULTIPLIER_NOTE, NoOpDpEvent
from privkit.events.mechanisms import NeighboringRelation
from privkit.ledger import Ledger
from privkit.mechanisms.bandmf import BANDMF_TRUST_ASSUMPTION, BandedToeplitzStrategy, BandMF

__all__ = ["BandedDpPlan", "PARTICIPATIONS", "banded_plan"]

PARTICIPATIONS = ("minsep", "cyclic", "poisson")
"""The participation schemas the trainers offer (module docstring)."""


@dataclass(frozen=True)
class BandedDpPlan:
    """Banded-MF client-level settings for one run (module docstring).

    Attributes:
        num_clients: N.
        rounds: T, the data rounds the strategy and the accounting are built for (the run
            may stop earlier; it never runs more).
        bands: b, the strategy's bands (1: independent noise, DP-FedAvg's).
        participation: ``minsep``, ``cyclic`` or ``poisson``.
        client_rate: q: the cohort is ``round(q N)`` (minsep) or each group member joins with
            probability q (poisson); unused by cyclic.
        groups: g, the cyclic groups (cyclic, poisson).
        l2_clip_norm, noise_multiplier: C and z (the stddev of the i.i.d. draws is z C).
        server_lr, server_momentum: the server optimiser.
        min_separation: minsep: s, the rounds between two participations of a client
            (default: the bands; 1 with ``bands`` 1 is independent noise with any
            participation, k = T).
    """

    kind = "client"

    num_clients: int
    rounds: int
    bands: int
    participation: str
    client_rate: float
    groups: int
    l2_clip_norm: float
    noise_multiplier: float
    server_lr: float = 1.0
    server_momentum: float = 0.0
    min_separation: int | None = None
    strategy: BandedToeplitzStrategy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = _validate.positive_int("num_clients", self.num_clients)
        t = _validate.positive_int("rounds", self.rounds)
        b = _validate.positive_int("bands", self.bands)
        if b > t:
            raise InvalidParameterError("bands", self.bands, f"at most the {t} data rounds")
        if self.participation not in PARTICIPATIONS:
            raise InvalidParameterError("participation", self.participation,
                                        f"one of {', '.join(PARTICIPATIONS)}")
        check_client_settings(self)
        g = _validate.positive_int("groups", self.groups)
        if self.min_separation is None:
            object.__setattr__(self, "min_separation", b)
        sep = _validate.positive_int("min_separation", self.min_separation)
        if sep > t:
            raise InvalidParameterError("min_separation", self.min_separation,
                                        f"at most the {t} data rounds")
        if self.participation != "minsep" and g > n:
            raise InvalidParameterError("groups", self.groups, f"at most the {n} clients")
        if self.participation == "poisson" and g < b:
            raise InvalidParameterError("groups", self.groups, f"at least --bands ({b}) "
                                        "with --participation poisson (amplified banded MF "
                                        "needs every client's rounds b apart)")
        if self.participation == "minsep" and self.cohort < 1:
            raise InvalidParameterError("client_rate", self.client_rate,
                                        f"at least 1 / N = {1 / n:.3g} (a cohort of round(q N) "
                                        ">= 1 client)")
        strategy = BandedToeplitzStrategy.identity() if b == 1 else \
            BandedToeplitzStrategy.optimized(b, t)
        object.__setattr__(self, "strategy", strategy)

    # -- the schema --------------------------------------------------------------------------
    @property
    def cohort(self) -> int:
        """minsep: the clients drawn each round, round(q N)."""
        return int(round(self.client_rate * self.num_clients))

    @property
    def max_participations(self) -> int:
        """The most rounds one client can take part in (public)."""
        s = self.separation if self.participation == "minsep" else self.groups
        return -(-self.rounds // s)

    @property
    def separation(self) -> int:
        """minsep: the rounds between two participations of a client."""
        return int(self.min_separation or self.bands)

    @property
    def schema(self) -> Any:
        """The accountant's participation schema."""
        if self.participation == "minsep":
            return MinSeparation(self.separation, self.max_participations)
        if self.participation == "cyclic":
            return Cyclic(self.groups)
        return CyclicPoisson(self.groups, self.client_rate)

    def group_size(self, data_round: int) -> int:
        """Clients of the group data round ``data_round`` serves (ids ``c`` with
        ``c mod g = (t - 1) mod g``)."""
        g, n = self.groups, self.num_clients
        j = (data_round - 1) % g
        return n // g + (1 if j < n % g else 0)

    def divisor(self, data_round: int) -> float:
        """The public number the noisy sum is divided by: the cohort m (minsep), the group's
        size (cyclic) or its expected sample q |group| (poisson)."""
        if self.participation == "minsep":
            return float(self.cohort)
        size = float(self.group_size(data_round))
        return size if self.participation == "cyclic" else self.client_rate * size

    # -- selection ---------------------------------------------------------------------------
    def select(self, tree: SeedTree, data_round: int, rng: Any = None,
               state: dict[str, Any] | None = None) -> np.ndarray:
        """The round's clients (sorted ids). Pure: ``state["bandmf_last"]`` (each client's
        last data round, 0 for never) is read, never written (:meth:`release` records)."""
        n = self.num_clients
        if self.participation == "minsep":
            last = _last(state, n)
            eligible = np.flatnonzero((last == 0) | (last <= data_round - self.separation))
            if rng is not None:
                u = np.asarray(rng.uniform(len(eligible)), dtype=np.float64)
            else:
                u = client_uniforms(tree, data_round, "bandmf-cohort", eligible, 1)[:, 0] \
                    if len(eligible) else np.zeros(0)
            take = np.argsort(u, kind="stable")[: self.cohort]
            return np.sort(eligible[take])
        members = np.arange((data_round - 1) % self.groups, n, self.groups)
        if self.participation == "cyclic":
            return members
        if rng is not None:
            u = np.asarray(rng.uniform(len(members)), dtype=np.float64)
        else:
            u = client_uniforms(tree, data_round, "bandmf-poisson", members, 1)[:, 0]
        return members[u < self.client_rate]

    # -- accounting --------------------------------------------------------------------------
    @property
    def neighboring_relation(self) -> Any:
        """The relation the schedule satisfies and the ledger prices under: zero-out for
        ``minsep`` (a fixed cohort size: module docstring), add/remove one client for
        ``cyclic`` and ``poisson`` (groups by client id, coins keyed by client id: an added
        client moves nobody else)."""
        if self.participation == "minsep":
            return NeighboringRelation.REPLACE_SPECIAL
        return NeighboringRelation.ADD_OR_REMOVE_ONE

    def round_events(self) -> tuple[Any, ...]:
        """Each data round's event (the same under every relation: the accountant applies
        the relation's sensitivity)."""
        return _round_events(self.strategy, self.noise_multiplier, self.rounds, self.schema)

    def entries(self, data_round: int, sel: Any = None, epochs: Any = None
                ) -> list[tuple[str, Any]]:
        """Round ``data_round``'s charge: its event from :func:`bandmf_round_events` (none
        where that event is a no-op)."""
        if not 1 <= data_round <= self.rounds:
            raise InvalidParameterError("data_round", data_round,
                                        f"in [1, {self.rounds}] (the rounds the run is priced "
                                        "for)")
        ev = self.round_events()[data_round - 1]
        return [] if isinstance(ev, NoOpDpEvent) else [(POPULATION, ev)]

    def run_event(self, rounds: int | None = None) -> Any:
        """The event of the first ``rounds`` data rounds (default: all T)."""
        evs = [e for e in self.round_events()[: self.rounds if rounds is None else rounds]
               if not isinstance(e, NoOpDpEvent)]
        return privkit.ComposedDpEvent(evs)

    # -- the release -------------------------------------------------------------------------
    def mechanism(self) -> BandMF:
        return BandMF(self.strategy, self.l2_clip_norm, self.noise_multiplier)

    @torch.no_grad()
    def release(self, w: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                state: dict[str, Any], generator: Any, *, sel: Any = None,
                data_round: int | None = None, canaries: Any = None
                ) -> dict[str, torch.Tensor]:
        """The new global model: clipped updates summed, round's correlated noise added
        (``state["bandmf"]``, the noise state, advanced), divided by the public divisor,
        the server step applied; ``sel`` is recorded in ``state["bandmf_last"]``.
        ``canaries``: an audit's :class:`~fl_examples.core.canaries.TrainerCanaries` (its
        schedule fits the participation: :func:`fl_examples.core.canaries.for_plan`), extra
        rows before the noise, scored from the noisy sum."""
        if sel is None or data_round is None:
            raise InvalidParameterError("sel", sel, "the round's clients and its data round "
                                        "(banded MF records who took part)")
        mech = self.mechanism()
        noise_state = state.get("bandmf") or mech.initial_state()
        if noise_state.next_round != data_round - 1:
            raise InvalidParameterError(
                "data_round", data_round, f"the noise state's next round + 1 "
                f"({noise_state.next_round + 1}): rounds must be released in order")
        delta = {k: local[k] - w[k].unsqueeze(0) for k in w}
        if canaries is not None:  # an audit's canary clients: extra rows before the noise
            delta = canaries.insert(delta, w, clip=self.l2_clip_norm, release=data_round)
        noisy, state["bandmf"] = mech(delta, noise_state, rng=generator)
        if canaries is not None:
            canaries.observe(noisy, release=data_round)
        last = _last(state, self.num_clients).copy()
        last[np.asarray(sel, dtype=np.int64)] = data_round
        state["bandmf_last"] = last
        if self.participation == "minsep":
            state["bandmf_shortfall"] = int(state.get("bandmf_shortfall", 0)) + int(
                len(sel) < self.cohort)
        d = self.divisor(data_round)
        mean = {k: noisy[k] / d for k in w}
        return server_step(w, mean, state, lr=self.server_lr, momentum=self.server_momentum)

    # -- checkpoints -------------------------------------------------------------------------
    def state_tensors(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors, JSON) of the banded state in ``state`` (empty before round 1)."""
        tensors: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if "bandmf" in state:
            t, meta = state["bandmf"].state_dict()
            tensors |= {f"bandmf.{k}": v for k, v in t.items()}
            extra["bandmf"] = meta
        if "bandmf_last" in state:
            tensors["bandmf_last"] = torch.as_tensor(state["bandmf_last"], dtype=torch.int64)
            extra["bandmf_shortfall"] = int(state.get("bandmf_shortfall", 0))
        return tensors, extra

    def load_state_tensors(self, tensors: dict[str, Any], extra: dict[str, Any],
                           state: dict[str, Any], like: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_tensors` wrote into ``state``."""
        if "bandmf" in extra:
            own = {k[len("bandmf."):]: v for k, v in tensors.items()
                   if k.startswith("bandmf.")}
            state["bandmf"] = self.mechanism().load_state(own, extra["bandmf"], like=like)
        if "bandmf_last" in tensors:
            state["bandmf_last"] = tensors["bandmf_last"].cpu().numpy().astype(np.int64)
            state["bandmf_shortfall"] = int(extra.get("bandmf_shortfall", 0))

    # -- the report --------------------------------------------------------------------------
    def public(self) -> list[str]:
        out = [f"N = {self.num_clients}: the number of clients",
               f"T = {self.rounds}: the data rounds the strategy is built and priced for",
               f"the strategy: {self.bands} bands (its coefficients follow from b and T)",
               "the number of data rounds"]
        if self.participation == "minsep":
            out.append(f"the cohort size m = {self.cohort} and divisor m, the separation "
                       f"{self.separation}; who took part in each round (the server knows it; "
                       "the guarantee does not hide it)")
            out.append("the population: which clients exist (zero-out protects what a "
                       "client's data contributes, not whether the client is in the "
                       "population)")
        elif self.participation == "cyclic":
            out.append(f"the {self.groups} groups (client id mod {self.groups}) and each "
                       "group's size, the divisor; who took part")
        else:
            out.append(f"the {self.groups} groups (client id mod {self.groups}), q = "
                       f"{self.client_rate:g} and the divisor q |group| (never the realised "
                       "sample)")
        return out

    def describe(self) -> dict[str, Any]:
        sens = bandmf_sensitivity(self.strategy, rounds=self.rounds, participation=self.schema)
        return {
            "mechanism": "banded matrix factorization (DP-FTRL)" if self.bands > 1 else
            "independent Gaussian noise (DP-FedAvg) under the same participation",
            "privacy_unit": "client", "bands": self.bands,
            "strategy_coefficients": list(self.strategy.coefficients),
            "participation": self.participation, "groups": self.groups
            if self.participation != "minsep" else None,
            "cohort": self.cohort if self.participation == "minsep" else None,
            "min_separation": self.separation if self.participation == "minsep" else None,
            "max_participations": self.max_participations,
            "sensitivity": {"value": sens.value, "exact": sens.exact, "method": sens.method},
            "l2_clip_norm": self.l2_clip_norm, "noise_multiplier": self.noise_multiplier,
            "noise_multiplier_note": NOISE_MULTIPLIER_NOTE,
            "noise_stddev_of_draws": self.noise_multiplier * self.l2_clip_norm,
            "client_rate": self.client_rate, "server_lr": self.server_lr,
            "server_momentum": self.server_momentum,
            "neighboring_relation": ("zero-out client (replace_special)"
                                     if self.participation == "minsep"
                                     else "add_or_remove_one client"),
            "trust": BANDMF_TRUST_ASSUMPTION,
            "assumptions": list(bandmf_assumptions(self.schema, self.neighboring_relation)),
            "band_time_axis": "data rounds (Upcycled-FL's even iterations touch no data and "
                              "do not advance the noise)"}

    def report(self, ledger: Ledger, num_clients: int, state: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        out = epsilon_section(ledger, [POPULATION]) | self.describe()
        ro = NeighboringRelation.REPLACE_ONE
        noise_state = (state or {}).get("bandmf")
        done = 0 if noise_state is None else int(noise_state.next_round)
        out["charged_rounds"] = done
        out["per_client"] = [out["epsilon_max"]] * num_clients
        out["epsilon_replace_one"] = _price(self.run_event(done), out["delta"], ro) \
            if done else 0.0
        if self.participation == "poisson":
            # against the server that draws the sample: the cyclic schema, no amplification
            cyc = bandmf_event(self.strategy, noise_multiplier=self.noise_multiplier,
                               rounds=self.rounds, participation=Cyclic(self.groups))
            out["epsilon_unamplified"] = {
                "epsilon_whole_run": _price(cyc, out["delta"], self.neighboring_relation),
                "note": "against anyone who knows which clients took part: the cyclic "
                        "schema's epsilon for the whole run, without amplification"}
        else:
            out["epsilon_unamplified"] = {
                "epsilon_whole_run": out["epsilon_max"],
                "note": "no amplification is used: the epsilon holds against the server"}
        if self.participation == "minsep":
            out["cohort_shortfall_rounds"] = int((state or {}).get("bandmf_shortfall", 0))
        out["public"] = self.public()
        return out


def _price(event: Any, delta: float, rel: Any = None) -> float:
    rel = rel or NeighboringRelation.ADD_OR_REMOVE_ONE
    return float(privkit.epsilon(event, delta, neighboring_relation=rel).epsilon)


_EVENTS: dict[Any, tuple[Any, ...]] = {}


def _round_events(strategy: Any, z: float, rounds: int, schema: Any) -> tuple[Any, ...]:
    """bandmf_round_events, memoised (a run asks for its round's event every round)."""
    key = (strategy, z, rounds, schema)
    if key not in _EVENTS:
        if len(_EVENTS) > 64:
            _EVENTS.clear()
        _EVENTS[key] = bandmf_round_events(strategy, noise_multiplier=z, rounds=rounds,
                                           participation=schema)
    return _EVENTS[key]


def _last(state: dict[str, Any] | None, n: int) -> np.ndarray:
    last = (state or {}).get("bandmf_last")
    return np.zeros(n, dtype=np.int64) if last is None else np.asarray(last, dtype=np.int64)


def banded_plan(*, num_clients: int, rounds: int, bands: int, participation: str,
                client_rate: float, groups: int | None, l2_clip_norm: float,
                noise_multiplier: float | None, noise_for_epsilon: float | None,
                delta: float, server_lr: float = 1.0, server_momentum: float = 0.0,
                min_separation: int | None = None) -> tuple[BandedDpPlan, dict[str, Any]]:
    """The plan (z given, or calibrated to ``noise_for_epsilon`` by
    :func:`privkit.accountants.calibrate_bandmf`) and the calibration record."""
    g = bands if groups is None else groups
    plan = BandedDpPlan(num_clients, rounds, bands, participation, client_rate, g,
                        l2_clip_norm, noise_multiplier or 1.0, server_lr, server_momentum,
                        min_separation)
    if noise_for_epsilon is None:
        return plan, {}
    cal = calibrate_bandmf(plan.strategy, target_epsilon=noise_for_epsilon, delta=delta,
                           rounds=rounds, participation=plan.schema,
                           neighboring_relation=plan.neighboring_relation)
    plan = BandedDpPlan(num_clients, rounds, bands, participation, client_rate, g,
                        l2_clip_norm, cal.noise_multiplier, server_lr, server_momentum,
                        min_separation)
    return plan, {"calibrated": {"parameter": "noise_multiplier", "value": cal.noise_multiplier,
                                 "target_epsilon": noise_for_epsilon, "statistic": "population",
                                 "planned_epsilon": cal.epsilon, "method": cal.method,
                                 "sensitivity": cal.sensitivity}}


def expected_clients(plan: BandedDpPlan) -> float:
    """The mean cohort over a cycle (for the reports)."""
    if plan.participation == "minsep":
        return float(plan.cohort)
    mean_group = plan.num_clients / plan.groups
    return mean_group if plan.participation == "cyclic" else plan.client_rate * mean_group

