"""Client-level DP without a trusted aggregator: distributed DP with secure aggregation in the
synchronous trainers (``--privacy client --aggregation distributed``).

DP-FedAvg (:class:`~fl_examples.core.dp_modes.ClientDpPlan`) trusts the server with the clipped
updates: it adds the Gaussian noise itself. Here every sampled client turns its own update into
integers and adds its own noise share (:class:`privkit.mechanisms.DistributedSkellam`: clip to
C, randomized Hadamard rotation from a **public** seed, scaling by the granularity gamma,
conditional randomized rounding, a ``Skellam(mu)`` share, reduction modulo ``2^bits``), and the
server learns only the sum modulo ``2^bits``. The secure sum is simulated exactly as modular
integer addition (:func:`privkit.mechanisms.distributed.secure_sum`, what SecAgg+ reveals);
the server decodes it (centre, unscale, rotate back) and divides by the public divisor q N,
then applies its learning rate and momentum as DP-FedAvg does.

Randomness. Client c's rounding coins and noise share come from its own stream
``distributed-noise/<c>`` of the data round in the seed tree (a counter-based key: adding or
zeroing another client never moves them), or from the OS CSPRNG with ``--secure-noise``; the
rotation seed of a round is public (stream ``distributed-rotation``; it never depends on the
updates). Poisson client sampling at rate q is DP-FedAvg's (the same coins, keyed by client id).

**Survivors.** The noise per client is calibrated so that a released sum holds at least
``min_survivors - colluders`` honest shares. With Poisson sampling the cohort is random: a data
round whose cohort (after FedAvg drops its stragglers) has fewer than ``min_survivors`` clients
is **skipped**: no client trains or encodes, nothing is released, nothing is charged, and the
server keeps its model. The default ``min_survivors`` is the largest n with
``P(Binomial(N, p) < n) <= 1%`` (p the inclusion rate: q, or q (1 - s) for FedAvg with
stragglers s): at most one round in a hundred is skipped; every client in every round
(q = 1) gives N. The trainer simulates no dropouts, so the survivors are the cohort.

**Shares scaled to the cohort** (``dropout_tolerance`` f in [0, 1], ``--dropout-tolerance``).
The ledger prices a released sum holding ``(n_min - k) mu`` of honest noise variance (k the
colluders). A released round of n >= n_min clients calibrates its shares for
``s(n) = max(n_min, ceil((1 - f) n))`` survivors: each client adds
``Skellam(mu_n)``, ``mu_n = mu (n_min - k) / (s(n) - k)`` <= mu, so any s(n) or more survivors,
k of them colluding, still hold ``(s(n) - k) mu_n >= (n_min - k) mu``: exactly what the event
charged on the ledger assumes. A released round must hold at least s(n) survivors (refused
otherwise, :meth:`DistributedDpPlan.check_survivors`; in this simulation the survivors are
the cohort, always enough). f = 1 gives s(n) = n_min: every client adds mu whatever the
cohort (the fixed-share protocol, which tolerates any dropouts down to n_min); f = 0, the
trainers' default (no dropouts here), makes a released sum carry exactly ``n_min mu`` (no
colluders) instead of ``n mu``: a deployment that must tolerate dropouts sets f to the share
of a cohort it expects to lose. Why this is sound: mu_n depends on the cohort's size n only,
and under zero-out (the relation priced: the target's update replaced by zero, the target
keeping its place, its coins and its noise share) the cohort, hence n and every mu_n, is the
same on neighbouring datasets: the shares are a function of the public sampling outcome,
never of the data, and each client still draws its share from its own stream (only the
Skellam parameter changes; adding or zeroing another client never moves a client's coins).
Nothing the ledger holds changes: the event (``(n_min - k)`` shares of mu), the skip rule,
q', n_min and the calibration. The wrap-around bound, computed for every client adding mu,
stays an upper bound (a sum of n shares of mu_n <= mu has less variance, and the bound grows
with the variance).

**Why a skipped round may charge nothing, and what a released one costs.** Whether a round is
skipped depends only on the sampling coins, never on data, so under zero-out (the target keeps
its place and its coins) the pattern of skipped rounds has the same law on neighbouring
datasets: it is treated as public, and the guarantee is stated conditionally on it (a
guarantee for every realised pattern). Given that a round is released, a client is in it with
probability ``q' = p P(Bin(N - 1, p) >= n - 1) / P(Bin(N, p) >= n)`` >= p (a large cohort
makes membership likelier), so a released round is charged the Skellam event amplified at q'
(joint convexity, :mod:`privkit.accountants.distributed`), a skipped one nothing. Against the
server, which knows the cohort, only the unamplified composition over the rounds a client was
released in holds (reported beside).

Charge order: the round's cohort is drawn, a skip is decided, then the round's event is
charged on the ledger (write-ahead) before any client draws its noise share.

Relation: **zero-out** (``REPLACE_SPECIAL``: one client's update replaced by zero, the client
keeping its place, its coins and its noise share), the ledger's; replace-one is reported
beside (twice the sensitivities). Add/remove is not priced: a removed client takes its noise
share away. Wrap-around of the modular sum is a utility failure, not a privacy one: the report
gives the calibrated per-round bound and, in this simulation, how many rounds did wrap
(computed from the noisy integer sums, a post-processing of what the Skellam bound prices).

**Audits** (``--audit-canaries M``, :mod:`fl_examples.core.canaries`): canary clients encoded
like a client without a noise share (:meth:`DistributedDpPlan.canary_input`) join the secure
sum of each released round they are sampled in (rate q'), never as survivors; they are scored
from the decoded sum, before the divisor, at the guaranteed noise multiplier (the released
sum's noise with f = 0 and no colluders, conservative otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

import privkit
from fl_examples.core.dp_modes import (
    POPULATION,
    ClientDpPlan,
    check_client_settings,
    server_step,
)
from fl_examples.core.seeds import SeedTree
from privkit import _validate
from privkit.accountants.distributed import (
    SKELLAM_NOTE,
    calibrate_distributed,
    finest_granularity,
    released_rate,
    skellam_chernoff_tail,
    wraparound_probability,
)
from privkit.errors import InvalidParameterError
from privkit.events.distributed import (
    DISTRIBUTED_TRUST_ASSUMPTION,
    MAX_NOISE_PER_CLIENT,
    padded_dimension,
)
from privkit.events.mechanisms import NeighboringRelation
from privkit.ledger import Ledger
from privkit.mechanisms.distributed import MAX_BITS, DistributedSkellam, center_modular

__all__ = ["DistributedDpPlan", "distributed_plan", "default_min_survivors", "released_rate",
           "cohort_bound", "granularity_for_noise", "rotation_seed", "AGGREGATIONS",
           "check_aggregation", "check_dropout_tolerance", "share_survivors",
           "SKIP_RATE", "COHORT_TAIL", "MAX_WRAP", "NOISE_STREAM", "ROTATION_STREAM"]

#: ``--aggregation``: ``central`` (DP-FedAvg, a trusted aggregator adds the noise) or
#: ``distributed`` (this module).
AGGREGATIONS = ("central", "distributed")
#: The default ``min_survivors`` skips a round with probability at most this.
SKIP_RATE = 0.01
#: The wrap-around bound is computed for the largest cohort but one in 10^9 rounds.
COHORT_TAIL = 1e-9
#: The calibrated per-round wrap-around bound (at the cohort bound).
MAX_WRAP = 1e-6
#: The relations a distributed run may be priced under.
RELATIONS = {"zero-out": NeighboringRelation.REPLACE_SPECIAL,
             "replace-one": NeighboringRelation.REPLACE_ONE}
#: Seed-tree streams: each client's rounding coins and noise share, and the public rotation.
NOISE_STREAM = "distributed-noise"
ROTATION_STREAM = "distributed-rotation"


# ---------------------------------------------------------------------------- cohorts
def check_dropout_tolerance(value: Any, name: str = "dropout_tolerance") -> float:
    """f as a float in [0, 1] (NaN refused), else :class:`InvalidParameterError` naming
    ``name``."""
    f = _validate.real(name, value)
    if not 0.0 <= f <= 1.0:
        raise InvalidParameterError(name, value, "in [0, 1] (the share of a released "
                                    "cohort that may drop out; 1: every client adds the "
                                    "share for min_survivors)")
    return f


def share_survivors(cohort: int, min_survivors: int, dropout_tolerance: float) -> int:
    """``s(n) = max(n_min, ceil((1 - f) n))``: the survivors a released cohort of n clients
    calibrates its noise shares for (module docstring; computed exactly, f as the binary
    fraction it is).

    Example:
        >>> [share_survivors(100, 78, f) for f in (0.0, 0.1, 1.0)]
        [100, 90, 78]
    """
    n = _validate.nonnegative_int("cohort", cohort)
    k = _validate.positive_int("min_survivors", min_survivors)
    f = check_dropout_tolerance(dropout_tolerance)
    return max(k, math.ceil((1 - Fraction(f)) * n))


def _binom() -> Any:
    from scipy.stats import binom

    return binom


def check_aggregation(aggregation: str | None, only_distributed: dict[str, Any]) -> bool:
    """``--aggregation`` (None: left out, as ``central``) is one of :data:`AGGREGATIONS`, and
    the settings only distributed DP uses (``only_distributed``, name -> value; None: not
    given) are given with ``distributed`` alone, else an error naming the first. Returns
    whether the aggregation is distributed.

    Example:
        >>> check_aggregation("central", {"min_survivors": None})
        False
    """
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise InvalidParameterError("aggregation", aggregation, "central or distributed")
    if aggregation == "distributed":
        return True
    for name, value in only_distributed.items():
        if value is not None:
            raise InvalidParameterError(name, value, "given only with --aggregation distributed")
    return False


def default_min_survivors(num_clients: int, rate: float) -> int:
    """The largest n with ``P(Binomial(N, p) < n) <= SKIP_RATE`` (at least 1): the default
    ``--min-survivors``. N when every client takes part (p = 1).

    Example:
        >>> default_min_survivors(2000, 0.05), default_min_survivors(100, 1.0)
        (78, 100)
    """
    n = _validate.positive_int("num_clients", num_clients)
    p = _validate.probability("rate", rate)
    if p == 1:
        return n
    return max(1, int(_binom().ppf(SKIP_RATE, n, p)))


def cohort_bound(num_clients: int, rate: float) -> int:
    """The largest cohort but one in ``1 / COHORT_TAIL`` rounds: the smallest m with
    ``P(Bin(N, p) > m) <= COHORT_TAIL`` (N at p = 1).

    Example:
        >>> cohort_bound(2000, 0.05), cohort_bound(50, 1.0)
        (163, 50)
    """
    n = _validate.positive_int("num_clients", num_clients)
    p = _validate.probability("rate", rate)
    if p == 1:
        return n
    return int(min(n, max(1, int(_binom().isf(COHORT_TAIL, n, p)))))


def rotation_seed(tree: SeedTree, data_round: int) -> int:
    """The public rotation seed of a data round (stream :data:`ROTATION_STREAM`)."""
    word = tree.sequence(data_round, ROTATION_STREAM).generate_state(1, np.uint64)[0]
    return int(word >> np.uint64(2))


def granularity_for_noise(noise_multiplier: float, *, clip: float, honest: int, clients: int,
                          dim: int, bits: int, beta: float = math.exp(-0.5),
                          max_wrap_probability: float = MAX_WRAP) -> tuple[float, float]:
    """(gamma, mu) for a given noise multiplier z: the sum's guaranteed noise (``honest``
    shares of ``Skellam(mu)``, times gamma) has stddev z C, and gamma is the finest grid whose
    wrap-around bound at ``clients`` contributions is at most ``max_wrap_probability`` (every
    standard deviation of the sum scales as 1 / gamma, so the bound falls as gamma grows:
    bisection on log gamma, as :func:`privkit.accountants.calibrate_distributed` does for a
    target epsilon).

    Raises:
        InvalidParameterError: naming ``bits``: no grid keeps the sum of ``clients`` clients
            within ``2^(bits-1)``.
    """
    z = _validate.positive("noise_multiplier", noise_multiplier)
    c = _validate.positive("clip", clip)
    h = _validate.positive_int("honest", honest)
    n = _validate.positive_int("clients", clients)
    d = padded_dimension(dim)
    b = _validate.positive_int("bits", bits)

    def mu(gamma: float) -> float:
        return (z * c / gamma) ** 2 / h

    def wrap(gamma: float) -> float:
        if mu(gamma) > MAX_NOISE_PER_CLIENT:
            return math.inf
        return wraparound_probability(clients=n, noise_per_client=mu(gamma),
                                      scaled_clip=c / gamma, padded_dim=d, bits=b)

    gamma = finest_granularity(
        wrap, clip=c, padded_dim=d, max_wrap_probability=max_wrap_probability, bits=bits,
        too_coarse=f"enough for {n} clients at noise multiplier {z:g}: their sum does not fit "
                   f"in 2^{b - 1} on any grid (raise --bits)")
    return gamma, mu(gamma)


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class DistributedDpPlan:
    """Distributed DP-FedAvg settings for one run (module docstring).

    Attributes:
        num_clients: N.
        client_rate: q, each client's Poisson probability of being sampled in a data round.
        drop_rate: s, the share of sampled clients dropped before the sum (FedAvg's
            stragglers; 0 otherwise): a client is in a sum with probability p = q (1 - s).
        l2_clip_norm: C.
        noise_per_client: mu, the Skellam variance per coordinate (integer units) of a share
            calibrated for n_min survivors: what the ledger prices ``(n_min - k)`` of, and the
            most a client adds (a round of n clients adds :meth:`noise_share` each).
        granularity: gamma, the grid step (update units).
        bits: the secure sum is taken modulo 2^bits.
        dim: the model's coordinates.
        min_survivors: n_min, the fewest clients a released sum holds.
        colluders: k, clients that may collude with the server (their shares not counted).
        server_lr, server_momentum: the server optimiser on the decoded mean.
        beta: the conditional rounding's parameter.
        relation: the relation the ledger prices under: ``zero-out`` (default; module
            docstring) or ``replace-one`` (twice the sensitivities).
        dropout_tolerance: f in [0, 1]: a released round of n clients calibrates its shares
            for ``max(n_min, ceil((1 - f) n))`` survivors (module docstring; 0, the default:
            no dropouts, a released sum carries the priced noise; 1: every client adds mu).
    """

    kind = "client"
    aggregation = "distributed"

    num_clients: int
    client_rate: float
    l2_clip_norm: float
    noise_per_client: float
    granularity: float
    bits: int
    dim: int
    min_survivors: int
    colluders: int = 0
    server_lr: float = 1.0
    server_momentum: float = 0.0
    drop_rate: float = 0.0
    beta: float = math.exp(-0.5)
    relation: str = "zero-out"
    dropout_tolerance: float = 0.0

    def __post_init__(self) -> None:
        if self.relation not in RELATIONS:
            raise InvalidParameterError("relation", self.relation, "zero-out or replace-one "
                                        "(add/remove is not priced: a removed client takes "
                                        "its noise share away)")
        n = _validate.positive_int("num_clients", self.num_clients)
        check_client_settings(_Settings(self.client_rate, self.l2_clip_norm, 1.0,
                                        self.server_lr, self.server_momentum))
        s = _validate.real("drop_rate", self.drop_rate)
        if not 0 <= s < 1:
            raise InvalidParameterError("drop_rate", self.drop_rate, "in [0, 1)")
        k = _validate.positive_int("min_survivors", self.min_survivors)
        if k > n:
            raise InvalidParameterError("min_survivors", self.min_survivors,
                                        f"at most the {n} clients")
        check_dropout_tolerance(self.dropout_tolerance)
        self.mechanism()  # validates the rest (bits, gamma, mu, colluders, ...)

    # -- numbers -----------------------------------------------------------------------------
    @property
    def neighboring_relation(self) -> NeighboringRelation:
        """The relation the ledger prices under (zero-out by default)."""
        return RELATIONS[self.relation]

    @property
    def expected_clients(self) -> float:
        """q N, the public divisor (as DP-FedAvg's)."""
        return self.client_rate * self.num_clients

    @property
    def inclusion_rate(self) -> float:
        """p = q (1 - s): a client's probability of being in a round's sum."""
        return self.client_rate * (1.0 - self.drop_rate)

    @functools.cached_property
    def released_rate(self) -> float:
        """q': the amplification of a released round (:func:`released_rate`)."""
        return released_rate(self.num_clients, self.inclusion_rate, self.min_survivors)

    @functools.cached_property
    def cohort_bound(self) -> int:
        """The largest cohort the wrap-around bound is computed for (:func:`cohort_bound`)."""
        return max(cohort_bound(self.num_clients, self.inclusion_rate), self.min_survivors)

    @functools.cached_property
    def wrap_bound(self) -> float:
        """A round's wrap-around probability bound: at :attr:`cohort_bound` clients, plus the
        chance of a larger cohort."""
        m = self.mechanism()
        tail = 0.0 if self.cohort_bound >= self.num_clients or self.inclusion_rate == 1 \
            else COHORT_TAIL
        return min(1.0, wraparound_probability(
            clients=self.cohort_bound, noise_per_client=float(self.noise_per_client),
            scaled_clip=m.scaled_clip, padded_dim=m.padded_dim, bits=int(self.bits)) + tail)

    def canary_details(self, m: int) -> dict[str, Any]:
        """What the report says of ``m`` audit canaries in this plan's sums (beside
        :meth:`~fl_examples.core.canaries.TrainerCanaries.describe`): the noise the scores
        are normalised by, what the Gaussian bound assumes, the wrap-around bound with them."""
        mech = self.mechanism()
        n, c, d = self.cohort_bound, mech.scaled_clip, mech.padded_dim
        # the canaries are orthogonal (one coordinate each): their sum's norm is sqrt(m) c
        v = (n * c + math.sqrt(m) * c) ** 2 / d
        t = 2.0 ** (int(self.bits) - 1) - (n + m)
        tail = 0.0 if self.cohort_bound >= self.num_clients or self.inclusion_rate == 1 \
            else COHORT_TAIL
        wrap = min(1.0, 2.0 * d * skellam_chernoff_tail(t, n * float(self.noise_per_client),
                                                        v) + tail)
        return {"note": "canary clients took part: extra contributions encoded like every "
                        "client (clipped to C, rotated, scaled, rounded, modulo 2^bits) but "
                        "adding no noise share, never touching a real client's data; they are "
                        "neither among num_clients nor among the survivors, and the divisor "
                        "is unchanged. The accounted epsilon covers each canary as one more "
                        "client (zero-out); the run's model carries their (tiny) updates",
                "noise_share": "none: the priced noise is the honest clients' Skellam shares; "
                               "a canary is one more unit of sensitivity (zero-out)",
                "noise_stddev_of_sum": self.noise_multiplier * self.l2_clip_norm,
                "noise_note": "the scores are in units of C with noise stddev z, the released "
                              "sum's guaranteed gamma sqrt((n_min - colluders) mu): with the "
                              "shares scaled to the cohort the sum's noise exactly at f = 0 "
                              "with no colluders, more otherwise",
                "scores_assume": "the Steinke et al. bound: nothing but the coins; the "
                                 "Gaussian one-run bound: Gaussian scores, here approximate "
                                 "(each decoded coordinate is a rotated sum of d Skellam "
                                 "coordinates, near Gaussian)",
                "wrap_bound_per_round": wrap,
                "wrap_note": "the wrap-around bound at the cohort bound with the m canaries' "
                             "residues in the sum (the plan's own bound is without them)"}

    @property
    def padded_dim(self) -> int:
        """d, the rotated length (a power of 2): each client sends d residues of ``bits``."""
        return padded_dimension(int(self.dim))

    @property
    def honest_shares(self) -> int:
        return int(self.min_survivors) - int(self.colluders)

    # -- shares scaled to the cohort (module docstring) --------------------------------------
    def share_survivors(self, cohort: int) -> int:
        """s(n) = ``max(n_min, ceil((1 - f) n))``: the survivors a released round of ``cohort``
        clients calibrates its shares for (:func:`share_survivors`)."""
        return share_survivors(cohort, int(self.min_survivors), float(self.dropout_tolerance))

    def noise_share(self, cohort: int) -> float:
        """mu_n, each client's Skellam variance in a released round of ``cohort`` clients:
        ``mu (n_min - k) / (s(n) - k)``, so that ``(s(n) - k) mu_n >= (n_min - k) mu`` (checked
        in floating point, rounded up where the division fell short); exactly mu when s(n) =
        n_min (f = 1, or a cohort of n_min)."""
        s = self.share_survivors(cohort)
        mu = float(self.noise_per_client)
        if s <= int(self.min_survivors):
            return mu
        k, h = int(self.colluders), self.honest_shares
        share = mu * h / (s - k)
        while (s - k) * share < h * mu:  # never below the priced variance
            share = math.nextafter(share, math.inf)
        return share

    def share_mechanism(self, cohort: int | None, bits: int | None = None
                        ) -> DistributedSkellam:
        """:meth:`mechanism` with the noise share of a released round of ``cohort`` clients
        (:meth:`noise_share`; the same encoder, only the Skellam parameter differs; ``None``:
        mu, the share for n_min survivors)."""
        mu = float(self.noise_per_client) if cohort is None else self.noise_share(cohort)
        base = self.mechanism(bits)
        if mu == float(base.noise_per_client):
            return base
        key = f"_share/{bits}/{mu!r}"  # memoised beside the fields, as mechanism()
        if key not in self.__dict__:
            self.__dict__[key] = dataclasses.replace(base, noise_per_client=mu)
        return self.__dict__[key]  # type: ignore[no-any-return]

    def check_survivors(self, cohort: int, survivors: int) -> int:
        """``survivors`` if a round whose ``cohort`` clients added shares for s(n) survivors
        may release a sum of that many; else :class:`InvalidParameterError` naming
        ``survivors`` (below s(n) the honest shares would hold less than the priced
        variance). Never raised in this simulation (the survivors are the cohort)."""
        s = _validate.nonnegative_int("survivors", survivors)
        need = self.share_survivors(cohort)
        if s < need:
            raise InvalidParameterError(
                "survivors", s, f">= {need} to release a round of {cohort} clients (their "
                f"shares were calibrated for max(n_min, ceil((1 - f) n)) = {need} survivors, "
                f"f = {self.dropout_tolerance:g}); discard the round")
        return s

    @property
    def noise_multiplier(self) -> float:
        """z: the guaranteed noise of a released sum (``min_survivors - colluders`` shares)
        as a standard deviation in update units over C, ``gamma sqrt((n - k) mu) / C``."""
        return float(self.granularity) * math.sqrt(self.honest_shares * float(
            self.noise_per_client)) / float(self.l2_clip_norm)

    @property
    def effective_noise_multiplier(self) -> float:
        return self.noise_multiplier

    def mechanism(self, bits: int | None = None) -> DistributedSkellam:
        """The clients' mechanism (``bits``: another modulus, for the unwrapped diagnostic)."""
        key = ("mechanism", bits)
        if key not in self.__dict__:  # a frozen dataclass: memoised beside the fields
            self.__dict__[key] = self._build(bits)
        return self.__dict__[key]  # type: ignore[no-any-return]

    def noiseless(self) -> DistributedSkellam:
        """The clients' encoder without the noise share (an audit's canary clients, modulo
        2^62 as :meth:`client_input`'s diagnostic; reduced to ``bits`` there)."""
        return self._noiseless

    @functools.cached_property
    def _noiseless(self) -> DistributedSkellam:
        return dataclasses.replace(self.mechanism(MAX_BITS), _noise=False)

    def _build(self, bits: int | None) -> DistributedSkellam:
        return DistributedSkellam(
            float(self.l2_clip_norm), float(self.granularity), float(self.noise_per_client),
            int(self.bits if bits is None else bits), int(self.dim), int(self.min_survivors),
            int(self.colluders), float(self.beta), float(self.released_rate))

    def round_event(self, neighboring_relation: Any = None) -> Any:
        """A released round's event: the Skellam sum amplified at q' (zero-out or
        replace-one; add/remove refused)."""
        return self.mechanism().event(neighboring_relation)

    # -- selection and charges ---------------------------------------------------------------
    def select(self, tree: SeedTree, data_round: int, rng: Any = None) -> np.ndarray:
        """Poisson sampling at q: DP-FedAvg's own sampler and coins
        (:meth:`~fl_examples.core.dp_modes.ClientDpPlan.select`, keyed by client id), or
        ``rng`` (:class:`privkit.SecureRandom`)."""
        return ClientDpPlan.select(self, tree, data_round, rng)  # type: ignore[arg-type]

    def skips(self, sel: Any) -> bool:
        """Whether a round whose sum would hold ``sel`` is skipped (fewer than n_min)."""
        return len(sel) < int(self.min_survivors)

    def entries(self, data_round: int, sel: Any = None, epochs: Any = None
                ) -> list[tuple[str, Any]]:
        """A released round's charge; none for a skipped one (``sel``: the round's cohort,
        after FedAvg drops its stragglers)."""
        if sel is not None and self.skips(sel):
            return []
        return [(POPULATION, self.round_event())]

    # -- the round ---------------------------------------------------------------------------
    def client_input(self, client: int, update: np.ndarray, *, rng: Any, rotation_seed: int,
                     cohort: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """What client ``client`` sends (``share_mechanism(cohort).encode``: residues modulo
        2^bits, the noise share of a released round of ``cohort`` clients; ``None``: mu, as
        ``mechanism().encode``) and, for the simulation's wrap-around diagnostic, the same
        integers before the reduction (encoded modulo 2^62 from the same draws: the residues
        are these reduced, bit for bit)."""
        wide = self.share_mechanism(cohort, MAX_BITS).encode(update, rng=rng,
                                                             rotation_seed=rotation_seed)
        return self._reduce(wide)

    def canary_input(self, vector: np.ndarray, *, rng: Any, rotation_seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """What an audit's canary client sends, as :meth:`client_input` returns it: the same
        encoder (clip to C, the round's public rotation, scaling, conditional rounding with
        ``rng``'s coins, the residues modulo 2^bits) with **no** noise share
        (:mod:`fl_examples.core.canaries`)."""
        return self._reduce(self.noiseless().encode(vector, rng=rng,
                                                    rotation_seed=rotation_seed))

    def _reduce(self, wide: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the residues modulo 2^bits, the centred integers) of an encoding modulo 2^62."""
        ints = center_modular(wide, MAX_BITS)
        mask = np.uint64((1 << int(self.bits)) - 1)
        return wide & mask, ints

    @torch.no_grad()
    def release(self, w: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                state: dict[str, Any], generator: Any = None, *, sel: Any, data_round: int,
                tree: SeedTree, secure: Any = None, canaries: Any = None
                ) -> dict[str, torch.Tensor]:
        """The new global model from the cohort's local models (rows in ``sel``'s order).

        A skipped round (fewer than n_min clients) returns ``w`` unchanged and releases
        nothing. Otherwise each client encodes its own update with its own stream (or
        ``secure``, a :class:`privkit.SecureRandom`) and its share for the round's cohort
        (:meth:`noise_share`), the residues are summed modulo 2^bits
        (:meth:`DistributedSkellam.secure_sum`; the survivors checked against s(n),
        :meth:`check_survivors`), the server decodes over q N and steps.
        ``state["distributed"]`` counts released, skipped and wrapped rounds,
        ``state["distributed_shares"]`` the shares drawn and their variance.
        ``generator`` (the central mode's noise stream) is not used.

        ``canaries``: an audit's :class:`~fl_examples.core.canaries.TrainerCanaries`
        (:func:`fl_examples.core.canaries.for_plan`). In a released round its canaries taking
        part are encoded by :meth:`canary_input` (no noise share, the canaries' own rounding
        coins: no client's stream moves) and their residues join the secure sum; they are
        not survivors (the skip is decided on ``sel`` alone, the divisor is q N) and they
        are scored from the decoded sum. A skipped round draws, releases and scores
        nothing."""
        counts = state.setdefault("distributed", {"released": 0, "skipped": 0, "wrapped": 0})
        if self.skips(sel):
            counts["skipped"] += 1
            return {k: v.clone() for k, v in w.items()}
        mech = self.mechanism()
        seed = rotation_seed(tree, data_round)
        names = list(w)
        cohort = len(sel)
        inputs, ints = [], []
        for j, c in enumerate(np.asarray(sel).tolist()):
            update = np.concatenate([(local[k][j] - w[k]).detach().to(torch.float64).cpu()
                                     .numpy().reshape(-1) for k in names])
            rng = secure if secure is not None else tree.numpy(data_round,
                                                               f"{NOISE_STREAM}/{int(c)}")
            y, x = self.client_input(int(c), update, rng=rng, rotation_seed=seed,
                                     cohort=cohort)
            inputs.append(y)
            ints.append(x)
        survivors = self.check_survivors(cohort, len(inputs))  # never a canary
        share = self.noise_share(cohort)
        shares = state.setdefault("distributed_shares",
                                  {"shares": 0, "variance": 0.0, "released_z": 0.0})
        shares["shares"] += survivors
        shares["variance"] += survivors * share
        shares["released_z"] += float(self.granularity) * math.sqrt(
            survivors * share) / float(self.l2_clip_norm)
        if canaries is not None:  # an audit's canary clients: encoded, no noise share
            take = canaries.begin(canaries.releases + 1, self.l2_clip_norm)
            for row in canaries.rows(take, self.l2_clip_norm):
                y, x = self.canary_input(row, rng=canaries.coins, rotation_seed=seed)
                inputs.append(y)
                ints.append(x)
        total = mech.secure_sum(inputs)
        half = 1 << (int(self.bits) - 1)
        exact = np.sum(ints, axis=0)
        counts["wrapped"] += int(bool(((exact < -half) | (exact >= half)).any()))
        counts["released"] += 1
        # the decoded sum (centred, unscaled, rotated back), then over the public q N
        total_sum = mech.decode(total, survivors=survivors, divisor=1.0, rotation_seed=seed)
        if canaries is not None:
            canaries.observe(total_sum)
        flat = total_sum / self.expected_clients
        mean, start = {}, 0
        for k in names:
            size = w[k].numel()
            mean[k] = torch.as_tensor(flat[start:start + size], dtype=w[k].dtype,
                                      device=w[k].device).reshape(w[k].shape)
            start += size
        return server_step(w, mean, state, lr=self.server_lr, momentum=self.server_momentum)

    # -- checkpoints -------------------------------------------------------------------------
    @staticmethod
    def state_json(state: dict[str, Any]) -> dict[str, Any]:
        """The round counters and the shares' totals to checkpoint (JSON)."""
        return {k: dict(state[k]) for k in ("distributed", "distributed_shares") if k in state}

    @staticmethod
    def load_state_json(saved: dict[str, Any], state: dict[str, Any]) -> None:
        if "distributed" in saved:
            state["distributed"] = {k: int(v) for k, v in saved["distributed"].items()}
        if "distributed_shares" in saved:
            state["distributed_shares"] = {
                k: int(v) if k == "shares" else float(v)
                for k, v in saved["distributed_shares"].items()}

    # -- the report --------------------------------------------------------------------------
    def public(self) -> list[str]:
        return [f"N = {self.num_clients}: the number of clients",
                f"q = {self.client_rate:g} and the divisor q N = {self.expected_clients:g}",
                f"the secure sum's modulus 2^{self.bits}, the granularity "
                f"{self.granularity:.6g}, the noise variance of a share for n_min survivors "
                f"{self.noise_per_client:.6g} (integer units), n_min = {self.min_survivors}, "
                f"{self.colluders} colluder(s), the dropout tolerance f = "
                f"{self.dropout_tolerance:g} (a round of n clients adds shares for "
                "max(n_min, ceil((1 - f) n)) survivors: its share is a function of the "
                "cohort's size, the same on neighbouring datasets under zero-out)",
                "every round's rotation seed (seed-tree stream "
                f"{ROTATION_STREAM!r}; it never depends on the updates)",
                "which data rounds were skipped (fewer than n_min clients sampled: decided by "
                "the sampling coins alone, the same law on neighbouring datasets under "
                "zero-out); the guarantee holds for the realised pattern",
                "the number of data rounds"]

    def assumptions(self) -> list[str]:
        amp = ("Poisson client sampling whose outcome stays secret from everyone but the "
               f"server: a released round is amplified at q' = {self.released_rate:.6g} by "
               "joint convexity (against outsiders only; epsilon_unamplified holds against "
               "the server)") if self.released_rate < 1 else \
            "every client in every round: no amplification (the epsilon holds against the " \
            "server too)"
        rel = ("zero-out: one client's update replaced by zero, the client keeping its place, "
               "its sampling coins and its noise share (replace-one reported beside; "
               "add/remove is not priced: a removed client takes its noise share away)"
               if self.relation == "zero-out" else
               "replace-one: one client's update replaced by any other (twice the "
               "sensitivities), the client keeping its place and its noise share")
        shares = (f"noise shares scaled to the cohort (f = {self.dropout_tolerance:g}): a "
                  "released round of n clients holds at least max(n_min, ceil((1 - f) n)) "
                  "survivors, the number its shares were calibrated for (refused otherwise; "
                  "in this simulation every sampled client survives)")
        return [DISTRIBUTED_TRUST_ASSUMPTION, amp, rel, shares, SKELLAM_NOTE]

    def describe(self) -> dict[str, Any]:
        m = self.mechanism()
        l2, l1 = m.sensitivities
        return {
            "mechanism": "distributed Skellam with secure aggregation (DP-FedAvg without a "
                         "trusted aggregator)",
            "privacy_unit": "client", "aggregation": "distributed",
            "l2_clip_norm": self.l2_clip_norm, "bits": int(self.bits),
            "granularity": self.granularity, "noise_per_client": self.noise_per_client,
            "noise_multiplier": self.noise_multiplier,
            "noise_multiplier_note": "the guaranteed noise of a released sum "
                                     "(min_survivors - colluders Skellam shares of "
                                     "noise_per_client, the variance the ledger prices) as a "
                                     "stddev in update units over C; the shares are scaled to "
                                     "the cohort (noise_shares): a released sum of n clients "
                                     "carries n mu_n, exactly (n_min - k) mu of honest "
                                     "variance when all survive at f = 0",
            "dropout_tolerance": float(self.dropout_tolerance),
            "noise_shares": "scaled to the cohort: in a released round of n clients each adds "
                            "Skellam(mu_n), mu_n = noise_per_client (n_min - k) / (s(n) - k), "
                            "shares for s(n) = max(n_min, ceil((1 - f) n)) survivors (any "
                            "s(n) survivors hold the priced (n_min - k) noise_per_client; a "
                            "round with fewer is refused); f = 1: every client adds "
                            "noise_per_client (the fixed-share protocol); the trainers "
                            "simulate no dropouts (default f = 0), a deployment that "
                            "tolerates them sets f",
            "noise_stddev_of_sum": self.noise_multiplier * self.l2_clip_norm,
            "min_survivors": int(self.min_survivors), "colluders": int(self.colluders),
            "honest_shares": self.honest_shares,
            "padded_dim": m.padded_dim, "rounded_norm_bound_sq": m.norm_bound_sq,
            "l2_sensitivity": l2, "l1_sensitivity": l1,
            "rounding": f"conditional randomized rounding (beta {self.beta:.4g}), redrawn until "
                        f"the integer vector's squared norm is <= {m.norm_bound_sq} (then "
                        "rounded towards zero): the sensitivities hold with probability 1, "
                        "nothing added to delta",
            "wrap_bound_per_round": self.wrap_bound, "cohort_bound": self.cohort_bound,
            "wrap_note": "wrap-around is a utility failure, not a privacy one; bound at the "
                         "largest likely cohort",
            "client_rate": self.client_rate, "inclusion_rate": self.inclusion_rate,
            "released_rate": self.released_rate, "expected_clients": self.expected_clients,
            "server_lr": self.server_lr, "server_momentum": self.server_momentum,
            "neighboring_relation": "zero-out client (replace_special)"
            if self.relation == "zero-out" else "replace_one client",
            "trust": DISTRIBUTED_TRUST_ASSUMPTION, "assumptions": self.assumptions()}

    def unamplified(self, rounds: int, delta: float) -> dict[str, Any]:
        """Against the server (it knows the cohort): a client's released rounds composed
        without amplification, at the expected count ceil(p R) and at every released round."""
        k_exp = max(1, math.ceil(self.inclusion_rate * rounds)) if rounds else 0

        def eps(k: int) -> float:
            if not k:
                return 0.0
            return privkit.epsilon(self.mechanism().unamplified_event(k), delta,
                                   neighboring_relation=self.neighboring_relation).epsilon

        return {"expected_participations": k_exp, "epsilon_at_expected": eps(k_exp),
                "every_round": rounds, "epsilon_every_round": eps(rounds),
                "note": "against anyone who knows which clients took part (the server that "
                        "sampled them): a client in k released rounds has the epsilon of k "
                        "Skellam releases, without amplification; skipped rounds release "
                        "nothing"}

    def report(self, ledger: Ledger, num_clients: int, state: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        out = _epsilon_section(ledger) | self.describe()
        rounds = int(sum(n for _, n in ledger.composition(POPULATION).atoms))
        counts = (state or {}).get("distributed", {})
        out["charged_rounds"] = rounds
        shares = (state or {}).get("distributed_shares", {})
        drawn = int(shares.get("shares", 0))
        released = int(counts.get("released", 0))
        out["mean_noise_per_client"] = (float(shares["variance"]) / drawn if drawn
                                        else float(self.noise_per_client))
        out["mean_released_noise_multiplier"] = (float(shares["released_z"]) / released
                                                 if released else self.noise_multiplier)
        out["mean_noise_note"] = ("the shares this run drew: mean variance per client share "
                                  "(integer units) and mean noise multiplier of a released "
                                  "sum (every share in it, colluders' too), over the released "
                                  "rounds (the plan's values when none was released)")
        out["skipped_rounds"] = int(counts.get("skipped", 0))
        out["wrapped_rounds"] = int(counts.get("wrapped", 0))
        out["wrapped_note"] = ("simulation diagnostic: rounds whose noisy integer sum left "
                               f"[-2^{self.bits - 1}, 2^{self.bits - 1}) (their decoded sum "
                               "wrapped); computed from the noisy sums the Skellam bound "
                               "prices, which a real server never sees")
        out["per_client"] = [out["epsilon_max"]] * num_clients
        ro = NeighboringRelation.REPLACE_ONE
        out["epsilon_replace_one"] = privkit.epsilon(
            privkit.SelfComposedDpEvent(self.round_event(ro), rounds), out["delta"],
            neighboring_relation=ro).epsilon if rounds else 0.0
        out["epsilon_unamplified"] = self.unamplified(rounds, out["delta"])
        out["public"] = self.public()
        return out


def _epsilon_section(ledger: Ledger) -> dict[str, Any]:
    """delta, the population's epsilon and the accountant that priced it, under the ledger's
    relation (zero-out: the Skellam event is not priced under add/remove)."""
    eps = float(ledger.epsilons([POPULATION])[POPULATION])
    delta = float(ledger.delta)
    atoms = ledger.composition(POPULATION).atoms
    method = privkit.epsilon(privkit.ComposedDpEvent(
        [privkit.SelfComposedDpEvent(a, n) for a, n in atoms]), delta,
        neighboring_relation=ledger.neighboring_relation).method if atoms else "none"
    return {"delta": delta, "epsilon_mean": eps, "epsilon_max": eps, "method": method,
            "proven": True}


@dataclass(frozen=True)
class _Settings:
    """The settings :func:`~fl_examples.core.dp_modes.check_client_settings` reads."""

    client_rate: float
    l2_clip_norm: float
    noise_multiplier: float
    server_lr: float
    server_momentum: float


def distributed_plan(*, num_clients: int, client_rate: float, l2_clip_norm: float, dim: int,
                     bits: int, rounds: int, delta: float, min_survivors: int | None = None,
                     colluders: int = 0, noise_multiplier: float | None = None,
                     noise_for_epsilon: float | None = None, server_lr: float = 1.0,
                     server_momentum: float = 0.0, drop_rate: float = 0.0,
                     relation: str = "zero-out", dropout_tolerance: float = 0.0
                     ) -> tuple[DistributedDpPlan, dict[str, Any]]:
    """The plan of a run and its calibration record.

    With ``noise_for_epsilon`` the noise per client and the granularity come from
    :func:`privkit.accountants.calibrate_distributed` for ``rounds`` released rounds
    amplified at q' (``relation``, ``min_survivors - colluders`` honest shares, the wrap-around
    bound at the cohort bound); else from ``noise_multiplier`` z (the released sum's guaranteed
    noise stddev over C, :func:`granularity_for_noise`). ``dropout_tolerance`` f scales each
    released round's shares to its cohort (module docstring); it changes nothing priced.

    Raises:
        InvalidParameterError: naming the setting (``min_survivors`` above N, ``colluders`` not
            below it, ``bits`` too few, an unreachable target, ...).
    """
    n = _validate.positive_int("num_clients", num_clients)
    q = _validate.probability("client_rate", client_rate)
    s = _validate.real("drop_rate", drop_rate)
    p = q * (1.0 - s)
    b = _validate.positive_int("bits", bits)
    if not 2 <= b <= MAX_BITS:
        raise InvalidParameterError("bits", bits, f"an integer in [2, {MAX_BITS}]")
    n_min = default_min_survivors(n, p) if min_survivors is None else \
        _validate.positive_int("min_survivors", min_survivors)
    if n_min > n:
        raise InvalidParameterError("min_survivors", min_survivors, f"at most the {n} clients")
    k = _validate.nonnegative_int("colluders", colluders)
    f = check_dropout_tolerance(dropout_tolerance)
    if k >= n_min:
        raise InvalidParameterError("colluders", colluders,
                                    f"< --min-survivors {n_min} (at least one honest share)")
    q_rel = released_rate(n, p, n_min)
    m = max(cohort_bound(n, p), n_min)
    base = dict(num_clients=n, client_rate=q, l2_clip_norm=l2_clip_norm, bits=b, dim=dim,
                min_survivors=n_min, colluders=k, server_lr=server_lr,
                server_momentum=server_momentum, drop_rate=s, relation=relation,
                dropout_tolerance=f)
    if noise_for_epsilon is None:
        z = 1.0 if noise_multiplier is None else noise_multiplier
        gamma, mu = granularity_for_noise(z, clip=l2_clip_norm, honest=n_min - k, clients=m,
                                          dim=dim, bits=b)
        return DistributedDpPlan(noise_per_client=mu, granularity=gamma, **base), {}
    cal = calibrate_distributed(noise_for_epsilon, delta, rounds=rounds, clients=m,
                                min_survivors=n_min, dim=dim, clip=l2_clip_norm, bits=b,
                                sampling_probability=q_rel, colluders=k,
                                neighboring_relation=RELATIONS[relation],
                                max_wrap_probability=MAX_WRAP)
    plan = DistributedDpPlan(noise_per_client=cal.noise_per_client,
                             granularity=cal.granularity, **base)
    return plan, {"calibrated": {
        "parameter": "noise_multiplier", "value": plan.noise_multiplier,
        "target_epsilon": noise_for_epsilon, "statistic": "population",
        "planned_epsilon": cal.epsilon, "method": cal.method,
        "noise_per_client": cal.noise_per_client, "granularity": cal.granularity,
        "planned_rounds": rounds, "released_rate": q_rel,
        "mse_ratio_to_central": cal.mse_ratio, "mse_ratio_to_central_rdp": cal.mse_ratio_rdp,
        "central_noise_multiplier": cal.central_noise_multiplier,
        "note": "the noise per client for `planned_rounds` released rounds (a skipped round "
                "charges nothing); mse_ratio_to_central: the decoded mean's error against "
                "DP-FedAvg's at the same target, rounds, sampling and relation, with every "
                "client of the cohort bound adding noise_per_client (f = 1; shares scaled to "
                "the cohort carry less)"}}
