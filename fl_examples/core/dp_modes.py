"""The two privacy models people train with, for the synchronous trainers: client-level
DP-FedAvg and record-level DP-SGD (public privkit API plus this package's solvers).

* :class:`ClientDpPlan` (``--privacy client``): Poisson client sampling at rate q in every data
  round, each sampled client's update (local model minus global) clipped to C, Gaussian noise
  N(0, (z C)^2) added once to the sum (:class:`privkit.ClientLevelGaussian`), divided by the
  expected number of clients q N, applied with a server learning rate and momentum (McMahan et
  al., ICLR 2018). The guarantee is the same for every client (add or remove one whole
  client), so the ledger holds one id, ``population``, charged once per data round before the
  noise is drawn. Assumes a trusted aggregator or secure aggregation.
* :class:`RecordDpPlan` (``--privacy record``): every participating client trains with DP-SGD
  (:mod:`fl_examples.core.dpsgd`) and is charged, before training, its own
  ``SelfComposedDpEvent(PoissonSampledDpEvent(b/n_i, GaussianDpEvent(z)), steps)`` for the
  round. The server's average is post-processing.

Both charge through :func:`charge_entries`, whose write order :meth:`entries` also gives
the crash-resume adoption (:func:`fl_examples.core.run.adopt_round_charges`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import privkit
from fl_examples.core.dpsgd import DpSgdSettings, round_event, steps_per_client
from fl_examples.core.privacy import BudgetStop
from fl_examples.core.rounds import poisson_sample
from fl_examples.core.seeds import SeedTree
from privkit import _validate
from privkit.errors import BudgetExceededError, InvalidParameterError
from privkit.events import NOISE_MULTIPLIER_NOTE
from privkit.events.mechanisms import NeighboringRelation
from privkit.ledger import Ledger
from privkit.mechanisms import row_l2_norms
from privkit.mechanisms.aggregate import (
    TRUST_ASSUMPTION,
    AdaptiveClipping,
    ClientLevelGaussian,
    unamplified_event,
)

__all__ = ["ClientDpPlan", "RecordDpPlan", "charge_entries", "server_step", "grouped",
           "calibrate_record", "check_client_settings", "epsilon_section",
           "replace_one_epsilons", "POPULATION", "COUNT_NOISE_RATIO", "adaptive_count_stddev",
           "adaptive_sum_noise"]

#: The ledger id of client-level DP: every client's guarantee is the population's.
POPULATION = "population"


#: Adaptive clipping's count noise is at least this many times the sum's (as noise
#: multipliers: ``2 count_stddev >= COUNT_NOISE_RATIO z``), so that the count never takes more
#: than a fixed share of the round's budget: the joint multiplier is at least
#: ``z / sqrt(1 + COUNT_NOISE_RATIO^-2)`` = 0.981 z.
COUNT_NOISE_RATIO = 5.0


def adaptive_count_stddev(expected_clients: float, noise_multiplier: float) -> float:
    """The count's stddev of adaptive clipping for a sum with noise multiplier z and an
    expected cohort m = q N: ``max(m / 20, COUNT_NOISE_RATIO z / 2)``.

    Andrew et al. (NeurIPS 2021) use m / 20 (the noisy fraction then has stddev 1/20), which
    costs almost nothing for large cohorts but dominates the budget for small ones (m = 15:
    the count's own noise multiplier is 1.5, so no target needing z >= 1.5 is reachable); the
    floor keeps the count's noise multiplier at least ``COUNT_NOISE_RATIO`` times the sum's.
    Both terms are public settings.

    Example:
        >>> adaptive_count_stddev(100, 0.86), adaptive_count_stddev(15, 1.3)
        (5.0, 3.25)
    """
    m = _validate.positive("expected_clients", expected_clients)
    z = _validate.positive("noise_multiplier", noise_multiplier)
    return max(m / 20, COUNT_NOISE_RATIO * z / 2)


def adaptive_sum_noise(expected_clients: float, joint_noise_multiplier: float) -> float:
    """The sum's z whose round, with :func:`adaptive_count_stddev`'s count, has the joint noise
    multiplier ``joint_noise_multiplier`` (always reachable).

    Example:
        >>> z = adaptive_sum_noise(15, 1.3)
        >>> c = 2 * adaptive_count_stddev(15, z)
        >>> round((z ** -2 + c ** -2) ** -0.5, 12)
        1.3
    """
    m = _validate.positive("expected_clients", expected_clients)
    zj = _validate.positive("joint_noise_multiplier", joint_noise_multiplier)
    zc = m / 10  # the count's noise multiplier at m / 20
    if zj < zc:
        z = zj / math.sqrt(1 - (zj / zc) ** 2)  # (zj^-2 - zc^-2)^-1/2, without overflow
        if COUNT_NOISE_RATIO * z <= zc:
            return z
    return zj * math.sqrt(1 + COUNT_NOISE_RATIO ** -2)


def server_step(w: dict[str, Any], mean: dict[str, Any], state: dict[str, Any], *,
                lr: float, momentum: float) -> dict[str, Any]:
    """The server's step on an averaged update: heavy ball ``buf <- m buf + mean`` (the
    buffer kept in ``state["momentum"]``; none at m = 0), then ``w + lr buf``."""
    if momentum:
        buf = state.get("momentum")
        mean = mean if buf is None else {k: momentum * buf[k] + mean[k] for k in w}
        state["momentum"] = mean
    return {k: w[k] + lr * mean[k] for k in w}


def _unflat(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``flat`` (``(d,)`` or ``(K, d)``, d the parameters of ``like`` in order) as a dict of
    ``like``'s shapes (with the leading K)."""
    lead = tuple(flat.shape[:-1])
    out, at = {}, 0
    for n, v in like.items():
        out[n] = flat[..., at:at + v.numel()].reshape(*lead, *v.shape)
        at += v.numel()
    return out


def charge_entries(ledger: Ledger, entries: Sequence[tuple[str, Any]], *, round_: int,
                   run_id: str, label: str) -> int:
    """Charge ``(client id, event)`` entries, grouped by event in order of first appearance
    (all or nothing); returns the last receipt's seq.

    Raises:
        BudgetStop: some client would exceed the budget (nothing is charged).
    """
    groups: dict[Any, list[str]] = {}
    for cid, ev in entries:
        groups.setdefault(ev, []).append(cid)
    if not groups:
        return -1
    try:  # one all-or-nothing write (one fsync) for the whole round
        return ledger.spend_many([(ids, ev) for ev, ids in groups.items()], label=label,
                                 round=round_, run_id=run_id).seq
    except BudgetExceededError as exc:
        raise BudgetStop(f"client(s) would exceed the budget in data round {round_}: {exc}"
                         ) from None


def grouped(entries: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``entries`` in the order :func:`charge_entries` writes them."""
    groups: dict[Any, list[str]] = {}
    for cid, ev in entries:
        groups.setdefault(ev, []).append(cid)
    return [(cid, ev) for ev, ids in groups.items() for cid in ids]


def epsilon_section(ledger: Ledger, ids: list[str]) -> dict[str, Any]:
    """delta, mean and max epsilon of ``ids`` and the accountant that priced the largest."""
    eps = ledger.epsilons(ids)
    arr = np.array([eps[i] for i in ids])
    rep = ledger.report(ids)
    top = ids[int(np.argmax(arr))]
    comp = ledger.composition(top)
    method = privkit.epsilon(privkit.ComposedDpEvent(
        [privkit.SelfComposedDpEvent(a, n) for a, n in comp.atoms]), rep.delta).method \
        if comp.atoms else rep.method.value
    return {"delta": rep.delta, "epsilon_mean": float(arr.mean()),
            "epsilon_max": float(arr.max()), "method": method, "proven": True}


def check_client_settings(plan: Any) -> None:
    """The settings every client-level plan shares: ``client_rate`` in (0, 1], positive
    ``l2_clip_norm`` (the flag ``--clip``), ``noise_multiplier`` and ``server_lr``, and
    ``server_momentum`` in [0, 1)."""
    q = _validate.positive("client_rate", plan.client_rate)
    if not q <= 1:
        raise InvalidParameterError("client_rate", plan.client_rate, "in (0, 1]")
    _validate.positive("clip", plan.l2_clip_norm)
    _validate.positive("noise_multiplier", plan.noise_multiplier)
    _validate.positive("server_lr", plan.server_lr)
    m = _validate.real("server_momentum", plan.server_momentum)
    if not 0 <= m < 1:
        raise InvalidParameterError("server_momentum", plan.server_momentum, "in [0, 1)")


@dataclass(frozen=True)
class ClientDpPlan:
    """Client-level DP-FedAvg settings for one run (module docstring).

    Attributes:
        num_clients: N, the population.
        client_rate: q, each client's Poisson probability of joining a data round, (0, 1].
        l2_clip_norm: C (the initial C with ``adaptive``).
        noise_multiplier: z of the sum.
        server_lr, server_momentum: the server optimiser applied to the noisy mean update.
        adaptive: quantile-tracking clip norm (its noisy count and the sum are one release a
            round, priced jointly).
    """

    kind = "client"

    num_clients: int
    client_rate: float
    l2_clip_norm: float
    noise_multiplier: float
    server_lr: float = 1.0
    server_momentum: float = 0.0
    adaptive: AdaptiveClipping | None = None

    def __post_init__(self) -> None:
        _validate.positive_int("num_clients", self.num_clients)
        check_client_settings(self)

    @property
    def expected_clients(self) -> float:
        return self.client_rate * self.num_clients

    def mechanism(self, clip: float | None = None) -> ClientLevelGaussian:
        return ClientLevelGaussian(self.l2_clip_norm if clip is None else clip,
                                   self.noise_multiplier, self.client_rate)

    def round_event(self, neighboring_relation: Any = None) -> Any:
        """The one event of a data round: the sum's, or with ``adaptive`` the sum and the
        count released on the same sample (one Gaussian, joint noise multiplier)."""
        if self.adaptive is not None:
            return self.adaptive.round_event(self.mechanism(), neighboring_relation)
        return self.mechanism().event(neighboring_relation)

    @property
    def effective_noise_multiplier(self) -> float:
        """z of the round's Gaussian (z_eff with ``adaptive``)."""
        if self.adaptive is not None:
            return self.adaptive.joint_noise_multiplier(self.noise_multiplier)
        return float(self.noise_multiplier)

    def select(self, tree: SeedTree, data_round: int, rng: Any = None) -> np.ndarray:
        """Poisson sampling: each client independently with probability q (sorted ids), from
        ``rng`` (a :class:`privkit.SecureRandom`: a coin per client) or else the seed tree
        (:func:`~fl_examples.core.rounds.poisson_sample`: whether client c is in depends on
        the seed, the round and c's id alone, not on N or anyone else; time proportional to
        the sample, not to N)."""
        if rng is not None:
            u = np.asarray(rng.uniform(self.num_clients), dtype=np.float64)
            return np.flatnonzero(u < self.client_rate)
        return poisson_sample(tree, data_round, self.num_clients, self.client_rate)

    def entries(self, data_round: int, sel: Any = None, epochs: Any = None
                ) -> list[tuple[str, Any]]:
        return [(POPULATION, self.round_event())]

    @torch.no_grad()
    def release(self, w: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                state: dict[str, Any], generator: Any, canaries: Any = None
                ) -> dict[str, torch.Tensor]:
        """The new global model from the sampled clients' local models (K may be 0).

        ``generator``: a ``torch.Generator`` on the models' device or a
        :class:`privkit.SecureRandom`. ``state`` holds the server's clip norm (``clip``)
        and momentum buffer (``momentum``) and is updated in place. A non-finite update
        contributes zeros (:class:`privkit.mechanisms.NonFiniteUpdates`), said nowhere.
        ``canaries``: an audit's :class:`~fl_examples.core.canaries.TrainerCanaries`, whose
        canary clients are extra rows of the sum before the noise (not of the adaptive
        count), scored from the noisy sum."""
        clip = float(state.get("clip", self.l2_clip_norm))
        mech = self.mechanism(clip)
        k = next(iter(local.values())).shape[0]
        # one (K, d) matrix of the updates: one clip of whole rows (a client's update is one
        # row, clipped jointly as before) and one noise draw, instead of one per parameter
        flat_w = torch.cat([v.reshape(-1) for v in w.values()])
        delta = torch.cat([local[n].reshape(k, v.numel()) for n, v in w.items()], 1)
        delta -= flat_w
        if self.adaptive is not None:
            norms = row_l2_norms(delta)  # float64, without a float64 copy of the rows
            state["clip"] = self.adaptive.update(clip, norms,
                                                 expected_clients=self.expected_clients,
                                                 rng=generator)
        if canaries is not None:  # an audit's canary clients: extra rows before the noise
            tree = canaries.insert(_unflat(delta, w), w, clip=clip)
            delta = torch.cat([tree[n].reshape(tree[n].shape[0], -1) for n in w], 1)
        noisy = mech({"update": delta}, rng=generator)["update"]
        if canaries is not None:
            canaries.observe(_unflat(noisy, w))
        mean = _unflat(noisy / self.expected_clients, w)
        return server_step(w, mean, state, lr=self.server_lr, momentum=self.server_momentum)

    def public(self) -> list[str]:
        """What the guarantee treats as public (the report says so)."""
        return [f"N = {self.num_clients}: the number of clients",
                f"q = {self.client_rate:g} and the divisor q N = {self.expected_clients:g} "
                "(the expected number of clients per round, never the realised one)",
                "the number of data rounds"]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mechanism": "client_level_gaussian (DP-FedAvg)", "privacy_unit": "client",
            "l2_clip_norm": self.l2_clip_norm, "noise_multiplier": self.noise_multiplier,
            "noise_multiplier_note": NOISE_MULTIPLIER_NOTE,
            "noise_stddev_of_sum": self.noise_multiplier * self.l2_clip_norm,
            "client_rate": self.client_rate, "expected_clients": self.expected_clients,
            "server_lr": self.server_lr, "server_momentum": self.server_momentum,
            "neighboring_relation": "add_or_remove_one client", "trust": TRUST_ASSUMPTION,
            "assumptions": [TRUST_ASSUMPTION, "Poisson client sampling whose outcome stays "
                            "secret from everyone but the server (amplification used; "
                            "epsilon_unamplified holds against the server)",
                            "add or remove one whole client"]}
        if self.adaptive is not None:
            out["adaptive_clipping"] = {
                "target_quantile": self.adaptive.target_quantile,
                "learning_rate": self.adaptive.learning_rate,
                "count_stddev": self.adaptive.count_stddev,
                "count": "centred (one client moves it by 1/2); released with the sum on the "
                         "same sample: one Gaussian per round",
                "joint_noise_multiplier": self.effective_noise_multiplier}
        return out

    #: The relation the ledger prices under: add or remove one client (Poisson sampling keyed
    #: by client id: adding a client never moves another).
    neighboring_relation = NeighboringRelation.ADD_OR_REMOVE_ONE

    def unamplified(self, rounds: int, delta: float, neighboring_relation: Any = None
                    ) -> dict[str, Any]:
        """Epsilon against someone who knows the sample: a client's own rounds composed,
        no amplification, at public participation counts (the expected ceil(q T), and every
        round; the realised counts would reveal the sample)."""
        k_exp = max(1, math.ceil(self.client_rate * rounds)) if rounds else 0
        z = self.effective_noise_multiplier
        rel = neighboring_relation or NeighboringRelation.ADD_OR_REMOVE_ONE

        def eps(k: int) -> float:
            if not k:
                return 0.0
            return privkit.epsilon(unamplified_event(z, k, neighboring_relation=rel), delta,
                                   neighboring_relation=rel).epsilon

        return {"expected_participations": k_exp, "epsilon_at_expected": eps(k_exp),
                "every_round": rounds, "epsilon_every_round": eps(rounds),
                "note": "against anyone who knows which clients took part (the server that "
                        "sampled them): a client in k rounds has the epsilon of k Gaussian "
                        "releases, without amplification"}

    def report(self, ledger: Ledger, num_clients: int) -> dict[str, Any]:
        out = epsilon_section(ledger, [POPULATION]) | self.describe()
        rounds = int(sum(n for _, n in ledger.composition(POPULATION).atoms))
        out["charged_rounds"] = rounds
        out["per_client"] = [out["epsilon_max"]] * num_clients  # the population's, for each
        ro = NeighboringRelation.REPLACE_ONE
        out["epsilon_replace_one"] = privkit.epsilon(
            privkit.SelfComposedDpEvent(self.round_event(ro), rounds), out["delta"],
            neighboring_relation=ro).epsilon if rounds else 0.0
        out["epsilon_unamplified"] = self.unamplified(rounds, out["delta"])
        out["public"] = self.public()
        return out


@dataclass(frozen=True)
class RecordDpPlan:
    """Record-level DP-SGD settings for one run (module docstring).

    Attributes:
        sizes: |D_i| per client.
        settings: clip, noise multiplier and expected minibatch size of DP-SGD.
    """

    kind = "record"
    #: The relation the ledgers price under: add or remove one record.
    neighboring_relation = NeighboringRelation.ADD_OR_REMOVE_ONE

    sizes: tuple[int, ...]
    settings: DpSgdSettings

    def entries(self, data_round: int, sel: Any, epochs: Any) -> list[tuple[str, Any]]:
        steps = steps_per_client([self.sizes[int(c)] for c in sel], epochs,
                                 self.settings.batch_size).tolist()
        return grouped([(str(int(c)), round_event(self.sizes[int(c)], int(s), self.settings))
                        for c, s in zip(sel, steps) if s > 0])

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {"mechanism": "record_level_dpsgd", "privacy_unit": "record",
                "l2_clip_norm": s.l2_clip_norm, "noise_multiplier": s.noise_multiplier,
                "noise_multiplier_note": NOISE_MULTIPLIER_NOTE,
                "expected_batch_size": s.batch_size,
                "sampling_rate_per_client": [min(1.0, s.batch_size / n) for n in self.sizes],
                "neighboring_relation": "add_or_remove_one record",
                "assumptions": ["Poisson-sampled local minibatches whose outcome stays "
                                "secret (amplification used)", "add or remove one record",
                                "every client's record count n_i is public (it sets the "
                                "sampling rate b/n_i and the steps): epsilon_replace_one is "
                                "the relation that keeps n_i fixed"]}

    @staticmethod
    def public() -> list[str]:
        return ["n_i: every client's record count (sampling rates b/n_i, steps, aggregation "
                "weights)", "N, and which clients take part in each round (record-level DP "
                "protects records, not participation)"]

    def report(self, ledger: Ledger, num_clients: int) -> dict[str, Any]:
        ids = [str(i) for i in range(num_clients)]
        eps = ledger.epsilons(ids)
        out = epsilon_section(ledger, ids) | self.describe()
        out["per_client"] = [eps[i] for i in ids]
        out["charged_steps"] = [int(sum(n for _, n in ledger.composition(i).atoms))
                                for i in ids]
        ro = replace_one_epsilons(ledger, ids, out["delta"])
        out["epsilon_replace_one_mean"] = float(np.mean(ro))
        out["epsilon_replace_one_max"] = float(np.max(ro))
        out["public"] = self.public()
        return out


def replace_one_epsilons(ledger: Ledger, ids: list[str], delta: float) -> np.ndarray:
    """Each client's epsilon with its ledger's events priced under replace-one: the same noise
    against twice the sensitivity (the accountant applies it: an event's noise multiplier is
    stddev / C under every relation)."""
    ro = NeighboringRelation.REPLACE_ONE
    comps = [ledger.composition(cid) for cid in ids]
    live = [privkit.ComposedDpEvent([privkit.SelfComposedDpEvent(a, n) for a, n in c.atoms])
            for c in comps if c.atoms]
    eps = iter(privkit.epsilon_batch(live, delta, neighboring_relation=ro) if live else [])
    return np.array([float(next(eps)) if c.atoms else 0.0 for c in comps])


def calibrate_record(counts: Sequence[int], sizes: Sequence[int], *, target: float,
                     delta: float, statistic: str, batch_size: int) -> tuple[float, float]:
    """z so that the run's mean (or max) per-client record-level epsilon is <= ``target``.

    ``counts`` are each client's planned DP-SGD steps over the whole run (from the seed tree);
    a client with ``n_i`` records is priced ``steps_i`` uses of PoissonSampled(b/n_i, G(z)).
    Bisection on log z (the answer is the evaluated safe end)."""
    if statistic not in ("mean", "max"):
        raise InvalidParameterError("noise_target", statistic, "mean or max")
    target = _validate.positive("noise_for_epsilon", target)
    live = [(int(c), int(n)) for c, n in zip(counts, sizes)]

    def eps_of(z: float) -> float:
        evs = []
        for c, n in live:
            if c == 0:
                continue
            q = min(1.0, batch_size / n)
            inner: Any = privkit.GaussianDpEvent(z)
            if q < 1:
                inner = privkit.PoissonSampledDpEvent(q, inner)
            evs.append(privkit.SelfComposedDpEvent(inner, c))
        if not evs:
            return 0.0
        e = privkit.epsilon_batch(evs, delta)
        zeros = sum(1 for c, _ in live if c == 0)
        if statistic == "max":
            return float(e.max())
        return float((e.sum()) / (len(e) + zeros))

    lo, hi = 0.3, 1.0
    while eps_of(hi) > target:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise InvalidParameterError("noise_for_epsilon", target, "reachable")
    while eps_of(lo) <= target and lo > 1e-3:
        hi, lo = lo, lo / 2
    while math.log(hi / lo) > 1e-3:
        mid = math.sqrt(lo * hi)
        if eps_of(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi, eps_of(hi)
