"""Server-side accounting of privkit's Flower strategies (the papers' algorithms).

:class:`ServerAccountant` is a privkit :class:`~privkit.ledger.Ledger` charged, before the
train messages leave, for every client sent work in a data round (write-ahead: a client that
then fails is still charged, an upper bound), never in Upcycled-FL's even rounds
(post-processing, Lemma 5.1). Each charge is one release of the client's mechanism
(:class:`privkit.flower.PrivacySettings`), recorded with ``round`` = Flower's server round.
Per-client epsilons are replayed from the ledger.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fl_examples.core.privacy import BudgetStop, PrivacyPlan
from privkit.errors import InvalidParameterError
from privkit.events.mechanisms import NeighboringRelation
from privkit.flower import records as keys
from privkit.flower.settings import PrivacySettings, rec_num_groups
from privkit.ledger import Ledger

__all__ = ["ServerAccountant", "settings_plan"]


def settings_plan(settings: PrivacySettings, sizes: Sequence[int], *, proximal_mu: float,
                  batch_size: int, momentum: float) -> PrivacyPlan:
    """The per-client privkit mechanisms for clients of these |D_i| (validates them all)."""
    if settings.kind == "rec":
        raise InvalidParameterError("privacy", "rec", "output or objective for a plan")
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
              if f.name not in ("clip", "bits", "groups")}
    return PrivacyPlan(sizes=tuple(int(n) for n in sizes), proximal_mu=float(proximal_mu),
                       batch_size=int(batch_size), momentum=float(momentum), **fields)


def relation_of(settings: PrivacySettings) -> Any:
    """The relation the settings' mechanism is priced under (None: DP-REC, whose events carry
    their own): output perturbation's replace-one (add/remove for the paper's sensitivity),
    objective perturbation's add/remove, as :class:`PrivacyPlan` charges them."""
    if settings.kind == "rec":
        return None
    if settings.kind == "output" and settings.sensitivity != "paper":
        return NeighboringRelation.REPLACE_ONE
    return NeighboringRelation.ADD_OR_REMOVE_ONE


class ServerAccountant:
    """A privkit ledger charged by a Flower strategy, one release per client per data round.

    Args:
        settings: the run's mechanism.
        ledger: a privkit :class:`~privkit.ledger.Ledger` (its delta and budget are the run's);
            a file-backed ledger survives restarts and never resets.
        run_id: recorded with every charge.
    """

    def __init__(self, settings: PrivacySettings, ledger: Ledger, *,
                 run_id: str = "flower") -> None:
        if not isinstance(settings, PrivacySettings):
            raise InvalidParameterError("privacy", settings, "a PrivacySettings")
        if not isinstance(ledger, Ledger):
            raise InvalidParameterError("ledger", ledger, "a privkit Ledger")
        need = relation_of(settings)
        if need is not None and ledger.neighboring_relation != need:
            raise InvalidParameterError(
                "ledger", ledger.neighboring_relation.name,
                f"a ledger for {need.name}: the {settings.kind} mechanism's sensitivity is "
                f"for it (Ledger.create(..., neighboring_relation={need.name!r}))")
        self.settings, self.ledger, self.run_id = settings, ledger, run_id
        self.plan: PrivacyPlan | None = None
        self.num_clients = 0

    def bind(self, sizes: Sequence[int], *, proximal_mu: float, batch_size: int,
             momentum: float) -> None:
        """Build every client's mechanism once the roster (client sizes) is known."""
        self.num_clients = len(sizes)
        if self.settings.kind != "rec":
            self.plan = settings_plan(self.settings, sizes, proximal_mu=proximal_mu,
                                      batch_size=batch_size, momentum=momentum)

    @property
    def bound(self) -> bool:
        """True once :meth:`bind` ran."""
        return self.num_clients > 0

    def _bound(self) -> PrivacyPlan:
        if self.plan is None:
            raise RuntimeError("ServerAccountant.bind() must run before charging")
        return self.plan

    def rec_event(self, leaf_sizes: Sequence[int]) -> Any:
        """The event of one DP-REC message of a model with arrays of these sizes."""
        from privkit.accountants.rec import RecDpEvent

        s = self.settings
        return RecDpEvent(noise_multiplier=s.stddev / s.l2_clip_norm,
                          num_candidates=1 << s.bits,
                          num_groups=rec_num_groups(s.groups, leaf_sizes))

    def charge(self, clients: Sequence[int], *, server_round: int,
               leaf_sizes: Sequence[int] = ()) -> None:
        """Charge one release to each client, all or nothing, before any work is sent.

        ``leaf_sizes`` (the model's array sizes) fix a DP-REC message's number of groups.

        Raises:
            fl_examples.core.privacy.BudgetStop: a client would exceed the budget; nothing
                is charged.
        """
        ids = [int(c) for c in clients]
        if self.settings.kind != "rec":
            self._bound().charge(self.ledger, ids, round_=int(server_round), run_id=self.run_id)
            return
        event = self.rec_event(leaf_sizes)
        over = self.ledger.would_exceed([str(c) for c in ids], event)
        if bool(over.any()):
            who = [str(c) for c, o in zip(ids, over) if o]
            raise BudgetStop(f"client(s) {', '.join(who[:5])} would exceed the budget in "
                             f"server round {server_round}")
        self.ledger.spend([str(c) for c in ids], event, label="DP-REC message",
                          round=int(server_round), run_id=self.run_id)

    def expected(self, client: int) -> tuple[str, float]:
        """(metric key, value) a client's reply must echo to show it applied the mechanism."""
        if self.settings.kind == "rec":
            raise InvalidParameterError("privacy", "rec", "output or objective (a DP-REC "
                                        "reply is checked by decoding it)")
        mech = self._bound().mechanism(int(client))
        if self.settings.kind == "output":
            return keys.NOISE_MULTIPLIER, float(mech.noise_multiplier)
        return keys.STEP_EPSILON, float(mech.step_epsilon)

    def epsilons(self) -> list[float]:
        """Per-client epsilon at the ledger's delta, client 0 first (0 for never charged)."""
        n = self.num_clients
        eps = self.ledger.epsilons([str(i) for i in range(n)])
        return [float(eps[str(i)]) for i in range(n)]

    def metrics(self) -> dict[str, Any]:
        """Round metrics: per-client epsilon (list, by client id), its mean and max, delta."""
        eps = self.epsilons()
        return {"privkit-epsilon": eps, "privkit-epsilon-mean": sum(eps) / len(eps),
                "privkit-epsilon-max": max(eps), "privkit-delta": float(self.ledger.delta)}

    def report(self) -> dict[str, Any]:
        """The privacy section of a report (as the batched trainers write it)."""
        if self.settings.kind == "rec":
            rep = self.ledger.report([str(i) for i in range(self.num_clients)])
            s = self.settings
            return {"mechanism": "dp_rec", "delta": rep.delta, "method": rep.method.value,
                    "epsilon_mean": rep.mean, "epsilon_max": rep.max,
                    "per_client": rep.epsilons.tolist(), "l2_clip_norm": s.l2_clip_norm,
                    "stddev": s.stddev, "bits": s.bits, "groups": s.groups}
        plan = self._bound()
        return plan.report(self.ledger, len(plan.sizes)) | {"clip": self.settings.clip}
