"""DP-REC's configuration (saved in the report), its data set and its model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fl_examples.core.canaries import check_count, refusal
from fl_examples.core.data import FederatedDataset, digits, parse_dataset_spec
from fl_examples.core.deep_models import CNN
from fl_examples.core.distributed import check_aggregation, check_dropout_tolerance
from fl_examples.core.models import MultinomialLogReg
from fl_examples.core.run import below_one, check_shared_settings, target_within_budget
from privkit import _validate
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import InvalidParameterError
from privkit.mechanisms import rec

__all__ = ["ALGORITHMS", "RELATIONS", "DEFAULT_CLIENTS_PER_ROUND", "DPRecConfig",
           "load_dataset", "relation_of", "check_relation", "distributed_dpfedavg",
           "DEFAULT_SECAGG_BITS"]


#: dprec: DP-REC; dpfedavg: DP-FedAvg (client-level, Poisson sampling); fedavg: the
#: non-private reference (DP-FedAvg's sampling and server step, no clipping, no noise).
ALGORITHMS = ("dprec", "dpfedavg", "fedavg")
REPLACE_ONE = NeighboringRelation.REPLACE_ONE
ADD_OR_REMOVE_ONE = NeighboringRelation.ADD_OR_REMOVE_ONE
ZERO_OUT = NeighboringRelation.REPLACE_SPECIAL
#: ``--relation`` values (neighbouring datasets differ in one whole client).
RELATIONS = {"add-remove": ADD_OR_REMOVE_ONE, "replace-one": REPLACE_ONE}
FLOAT_BITS = 32
#: DP-FedAvg's secure-sum modulus exponent under ``aggregation="distributed"`` when
#: ``secagg_bits`` is left out (upcycled's ``--bits`` default).
DEFAULT_SECAGG_BITS = 20
#: DP-REC's draws per round when ``clients_per_round`` is not given: ``min(30, N)``, every
#: client of a federation of 30 or fewer (the paper gives no value).
DEFAULT_CLIENTS_PER_ROUND = 30


@dataclass(frozen=True)
class DPRecConfig:
    """Everything a run needs; saved in the report.

    Attributes:
        dataset: ``digits`` (split over ``clients`` clients, ``digits_classes`` classes each),
            ``synthetic:A,B``, ``femnist:DIR``, ... (:func:`parse_dataset_spec`).
        clients: N for ``digits`` (other data sets bring their own client count).
        digits_classes: classes per client for ``digits`` (0: IID).
        model: ``logreg`` or ``cnn`` (a small CNN: 3 channels, one hidden layer of 100).
        clients_per_round: |S'|, DP-REC's draws per round (with replacement); None:
            ``min(30, N)`` (:data:`DEFAULT_CLIENTS_PER_ROUND`, or every client of a smaller
            federation), resolved when the data set is loaded.
        client_rate: q, DP-FedAvg's (and FedAvg's) Poisson rate: each client joins a round
            independently with probability q, in (0, 1]; None: ``clients_per_round / N``
            (the same expected participation as DP-REC).
        rounds: T.
        bits: b, REC bits per group (K = 2**b).
        groups: REC grouping: ``per-layer`` (= per-tensor), ``whole``, ``per-parameter`` or
            ``chunks:N``.
        l2_clip: C, the update clip norm (DP-REC and DP-FedAvg).
        stddev: sigma, REC prior/target std (DP-REC's noise, default 1); refused with
            ``epsilon``, which calibrates it.
        local_epochs, batch_size, lr: local SGD (no momentum).
        server_lr, server_momentum: the server step on the averaged update (heavy ball,
            ``buf <- m buf + mean; w <- w + lr buf``), the same for every algorithm.
        delta: delta of every epsilon.
        epsilon: target central epsilon: DP-REC's ``stddev`` and DP-FedAvg's noise multiplier
            are both calibrated to reach it after ``rounds`` rounds (each under its relation);
            None: DP-REC uses ``stddev`` and DP-FedAvg is calibrated to DP-REC's epsilon.
        epsilon_budget: central-epsilon budget; the run stops before exceeding it.
        dpfedavg_noise: DP-FedAvg noise multiplier z = stddev of the sum / C (None:
            calibrated).
        relation: the neighbouring relation (one whole client): ``add-remove`` or
            ``replace-one``; None: each algorithm's default (DP-FedAvg add-remove, DP-REC
            replace-one, the only relation its bound is proven under; ``add-remove`` is
            refused when DP-REC runs).
        history_compression: send returning clients the message history when shorter
            (default on).
        secure_noise: the samples, REC selections and noise of DP-REC and DP-FedAvg from the
            OS CSPRNG (otherwise the run is a seeded simulation).
        eval_client_data: the private algorithms also evaluate on the clients' data (listed
            as not covered by their epsilon).
        audit_canaries: M > 0 plants M white-box canary clients in DP-FedAvg's noisy sums
            (``distributed``: in its secure sums, encoded like a client without a noise share)
            and audits its run (:mod:`fl_examples.core.canaries`); refused unless dpfedavg runs.
        aggregation: DP-FedAvg's aggregation: ``central`` (the server adds the noise; the
            default when DP-FedAvg runs) or ``distributed`` (each sampled client adds its own
            Skellam noise share and the server learns the sum modulo ``2^secagg_bits`` through
            secure aggregation, :mod:`fl_examples.core.distributed`; zero-out relation, or
            replace-one with ``relation``; add-remove refused).
        secagg_bits, min_survivors, colluders: ``distributed`` only: the modulus exponent
            (default :data:`DEFAULT_SECAGG_BITS`), the fewest clients a released sum holds
            (a round with a smaller sample is skipped: nothing released or charged; default
            the largest n with P(sample < n) <= 1%) and the clients that may collude with the
            server (default 0).
        dropout_tolerance: ``distributed`` only: f in [0, 1], a released round of n clients
            adds noise shares for ``max(min_survivors, ceil((1 - f) n))`` survivors (default
            0: the simulation has no dropouts; 1: every client adds the share for
            min_survivors, the fixed-share protocol; a deployment that tolerates dropouts
            sets f). The epsilon does not change.

    The settings of one algorithm (``stddev``, ``bits``, ``groups``, ``history_compression``
    for DP-REC; ``dpfedavg_noise`` for DP-FedAvg; ``client_rate``; ``clients`` and
    ``digits_classes`` for digits) are None until :meth:`resolved` fills them for the
    algorithms that run; given for one that does not, they are refused.
        seed: root of the seed tree; device: auto, cpu, cuda; eval_every: rounds between
            evaluations.
        checkpoint_every: with an output directory, checkpoint every N rounds (and at the
            end) into ``OUT/checkpoints/<algorithm>/``; 0: never.
    """

    dataset: str = "digits"
    clients: int | None = None
    digits_classes: int | None = None
    model: str = "logreg"
    clients_per_round: int | None = None
    client_rate: float | None = None
    rounds: int = 50
    bits: int | None = None
    groups: str | None = None
    l2_clip: float = 0.5
    stddev: float | None = None
    local_epochs: int = 5
    batch_size: int = 16
    lr: float = 0.5
    server_lr: float = 1.0
    server_momentum: float = 0.0
    delta: float = 1e-5
    epsilon: float | None = None
    epsilon_budget: float | None = None
    dpfedavg_noise: float | None = None
    relation: str | None = None
    history_compression: bool | None = None
    seed: int = 0
    device: str = "auto"
    eval_every: int = 5
    checkpoint_every: int = 0
    secure_noise: bool = False
    eval_client_data: bool = False
    audit_canaries: int = 0
    aggregation: str | None = None
    secagg_bits: int | None = None
    min_survivors: int | None = None
    colluders: int | None = None
    dropout_tolerance: float | None = None

    def __post_init__(self) -> None:
        if self.clients is not None:
            _validate.positive_int("clients", self.clients)
        if self.digits_classes is not None:
            d = _validate.nonnegative_int("digits_classes", self.digits_classes)
            if d > 10:
                raise InvalidParameterError("digits_classes", d, "in [0, 10]")
        if self.model not in ("logreg", "cnn"):
            raise InvalidParameterError("model", self.model, "logreg or cnn")
        if self.clients_per_round is not None:
            _validate.positive_int("clients_per_round", self.clients_per_round)
        if self.client_rate is not None:
            _validate.probability("client_rate", self.client_rate)
        _validate.positive_int("rounds", self.rounds)
        if self.bits is not None and (isinstance(self.bits, bool)
                                      or not isinstance(self.bits, int)
                                      or not rec.MIN_BITS <= self.bits <= rec.MAX_BITS):
            raise InvalidParameterError("bits", self.bits, "an integer in [1, 24]")
        if self.groups is not None:
            rec._check_grouping(self.groups)  # noqa: SLF001 - the mechanism's validation
            if self.groups not in ("per-layer", "per-tensor", "whole", "per-parameter") \
                    and not self.groups.startswith("chunks:"):
                raise InvalidParameterError("groups", self.groups,
                                            "per-layer, whole, per-parameter or chunks:N")
        _validate.positive("l2_clip", self.l2_clip)
        if self.stddev is not None:
            _validate.positive("stddev", self.stddev)
        check_count(self.audit_canaries, checkpoint_every=self.checkpoint_every)
        _validate.positive("server_lr", self.server_lr)
        below_one("server_momentum", self.server_momentum)
        target_within_budget("epsilon", self.epsilon, self.epsilon_budget)
        if self.dpfedavg_noise is not None:
            _validate.positive("dpfedavg_noise", self.dpfedavg_noise)
        if self.relation is not None and self.relation not in RELATIONS:
            raise InvalidParameterError("relation", self.relation,
                                        "add-remove or replace-one")
        check_shared_settings(self)  # local solver, delta, budget, seed, eval/checkpoint grid
        self._check_aggregation()

    def _check_aggregation(self) -> None:
        """``aggregation`` and the settings only distributed DP uses (one line each)."""
        own = ("secagg_bits", "min_survivors", "colluders", "dropout_tolerance")
        if not check_aggregation(self.aggregation, {n: getattr(self, n) for n in own}):
            return
        if self.relation == "add-remove":
            raise InvalidParameterError(
                "relation", self.relation, "zero-out (unset) or replace-one with --aggregation "
                "distributed (a client added or removed brings or takes away its noise share)")
        if self.secagg_bits is not None:
            b = _validate.positive_int("secagg_bits", self.secagg_bits)
            if not 2 <= b <= 62:
                raise InvalidParameterError("secagg_bits", b, "an integer in [2, 62]")
        if self.min_survivors is not None:
            _validate.positive_int("min_survivors", self.min_survivors)
        if self.colluders is not None:
            k = _validate.nonnegative_int("colluders", self.colluders)
            if self.min_survivors is not None and k >= self.min_survivors:
                raise InvalidParameterError("colluders", k, f"< --min-survivors "
                                            f"{self.min_survivors} (one honest noise share)")
        if self.dropout_tolerance is not None:
            check_dropout_tolerance(self.dropout_tolerance)

    @property
    def distributed(self) -> bool:
        """DP-FedAvg without a trusted aggregator (``aggregation="distributed"``)."""
        return self.aggregation == "distributed"

    def resolved(self, algorithms: tuple[str, ...], *, check: bool = True) -> DPRecConfig:
        """This configuration with the settings left at None filled for ``algorithms`` (what
        the run uses, and what the report records). With ``check``, a setting given for an
        algorithm that does not run, or one that ``epsilon`` calibrates, is refused by name.
        """
        import dataclasses

        runs = set(algorithms)
        digits_data = self.dataset.strip().lower() == "digits"
        applies = {"stddev": "dprec" in runs, "bits": "dprec" in runs,
                   "groups": "dprec" in runs, "history_compression": "dprec" in runs,
                   "dpfedavg_noise": "dpfedavg" in runs,
                   "client_rate": bool(runs & {"dpfedavg", "fedavg"}),
                   "clients": digits_data, "digits_classes": digits_data,
                   "secure_noise": bool(runs & {"dprec", "dpfedavg"}),
                   "eval_client_data": bool(runs & {"dprec", "dpfedavg"}),
                   "aggregation": "dpfedavg" in runs}
        why = {"stddev": "DP-REC runs", "bits": "DP-REC runs", "groups": "DP-REC runs",
               "history_compression": "DP-REC runs", "dpfedavg_noise": "DP-FedAvg runs",
               "client_rate": "DP-FedAvg or FedAvg runs",
               "clients": "--dataset digits (other data sets bring their own clients)",
               "digits_classes": "--dataset digits",
               "secure_noise": "a private algorithm (dprec, dpfedavg) runs",
               "eval_client_data": "a private algorithm (dprec, dpfedavg) runs",
               "aggregation": "DP-FedAvg runs (--algorithms)"}
        if check:
            for name, ok in applies.items():
                value = getattr(self, name)
                if value is not None and value is not False and not ok:
                    raise InvalidParameterError(name, value, f"given only when {why[name]}")
            if self.audit_canaries and "dpfedavg" not in runs:
                raise refusal(self.audit_canaries, "unless dpfedavg runs (--algorithms): the "
                              "canaries go in DP-FedAvg's noisy sums; DP-REC's messages are "
                              "REC selections among candidates, no additive noise to project "
                              "a canary on (privkit audit rec audits the encoder), and fedavg "
                              "is not private")
            if self.epsilon is not None and self.stddev is not None and "dprec" in runs:
                raise InvalidParameterError("stddev", self.stddev, "left out with "
                                            "--noise-for-epsilon (which calibrates DP-REC's "
                                            "stddev)")
        fill = {"stddev": 1.0, "bits": 8, "groups": "per-layer", "history_compression": True,
                "clients": 100, "digits_classes": 0, "aggregation": "central"}
        new = {k: v for k, v in fill.items() if getattr(self, k) is None and applies[k]}
        if self.distributed and "dpfedavg" in runs:
            new |= {k: v for k, v in (("secagg_bits", DEFAULT_SECAGG_BITS),
                                      ("colluders", 0), ("dropout_tolerance", 0.0))
                    if getattr(self, k) is None}
        return dataclasses.replace(self, **new) if new else self

    def draws_per_round(self, num_clients: int) -> int:
        """|S'|: ``clients_per_round``, else ``min(30, N)``."""
        if self.clients_per_round is not None:
            return int(self.clients_per_round)
        return min(DEFAULT_CLIENTS_PER_ROUND, int(num_clients))

    def for_clients(self, num_clients: int) -> DPRecConfig:
        """This configuration with ``clients_per_round`` filled for a federation of
        ``num_clients`` (what the run uses, and what the report records)."""
        import dataclasses

        if self.clients_per_round is not None:
            return self
        return dataclasses.replace(self, clients_per_round=self.draws_per_round(num_clients))

    def client_rate_for(self, num_clients: int) -> float:
        """q of DP-FedAvg and FedAvg: ``client_rate``, else ``clients_per_round / N``."""
        if self.client_rate is not None:
            return float(self.client_rate)
        return min(1.0, self.draws_per_round(num_clients) / num_clients)


def relation_of(cfg: DPRecConfig, algorithm: str) -> NeighboringRelation:
    """The neighbouring relation ``algorithm`` is priced under (:attr:`DPRecConfig.relation`;
    unset: DP-REC replace-one, DP-FedAvg add-remove, or zero-out with distributed
    aggregation)."""
    if algorithm == "dpfedavg" and cfg.distributed and cfg.relation is None:
        return ZERO_OUT
    if cfg.relation is not None:
        return RELATIONS[cfg.relation]
    return REPLACE_ONE if algorithm == "dprec" else ADD_OR_REMOVE_ONE


def check_relation(cfg: DPRecConfig, algorithm: str) -> None:
    """Refuse a relation ``algorithm`` has no proven bound for (DP-REC: replace-one only)."""
    if algorithm == "dprec" and relation_of(cfg, algorithm) != REPLACE_ONE:
        raise InvalidParameterError(
            "relation", cfg.relation,
            "replace-one (or unset) when DP-REC runs: its message bound and its "
            "with-replacement amplification are proven under replace-one only; for DP-FedAvg "
            "under add-remove alone use --algorithms dpfedavg")


def distributed_dpfedavg(cfg: DPRecConfig, ds: FederatedDataset, *,
                         noise_multiplier: float | None = None, target: float | None = None
                         ) -> tuple[Any, dict[str, Any]]:
    """DP-FedAvg's plan and calibration record under ``aggregation="distributed"``
    (:func:`fl_examples.core.distributed.distributed_plan`): the noise shares calibrated to
    ``target`` over ``cfg.rounds`` rounds, or set by ``noise_multiplier`` (the released sum's
    guaranteed noise stddev over C), under zero-out or ``--relation replace-one``."""
    from fl_examples.core.distributed import distributed_plan
    from fl_examples.core.models import num_parameters

    n = ds.num_clients
    return distributed_plan(
        num_clients=n, client_rate=cfg.client_rate_for(n), l2_clip_norm=cfg.l2_clip,
        dim=num_parameters(_model(cfg, ds)), bits=cfg.secagg_bits or DEFAULT_SECAGG_BITS,
        rounds=cfg.rounds, delta=cfg.delta, min_survivors=cfg.min_survivors,
        colluders=cfg.colluders or 0, noise_multiplier=noise_multiplier,
        noise_for_epsilon=target, server_lr=cfg.server_lr,
        server_momentum=cfg.server_momentum,
        relation="replace-one" if cfg.relation == "replace-one" else "zero-out",
        dropout_tolerance=0.0 if cfg.dropout_tolerance is None else cfg.dropout_tolerance)


def load_dataset(cfg: DPRecConfig) -> FederatedDataset:
    """``digits`` over ``cfg.clients`` clients, else :func:`parse_dataset_spec`; refuses more
    clients per round than there are clients (DP-FedAvg's default client rate is
    ``clients_per_round / N``)."""
    name = cfg.dataset.strip().lower()
    if name == "digits":
        ds = digits(rng=cfg.seed, num_clients=cfg.clients or 100,
                    classes_per_client=cfg.digits_classes or None)
    else:
        ds = parse_dataset_spec(cfg.dataset, seed=cfg.seed)
    if cfg.clients_per_round is not None and cfg.clients_per_round > ds.num_clients:
        raise InvalidParameterError("clients_per_round", cfg.clients_per_round,
                                    f"at most the number of clients ({ds.num_clients})")
    return ds


def _model(cfg: DPRecConfig, ds: FederatedDataset) -> Any:
    if cfg.model == "cnn":
        side = math.isqrt(ds.num_features)
        if side * side != ds.num_features:
            raise InvalidParameterError("model", "cnn", "used with square images")
        return CNN(image_size=side, channels=3, hidden=(100,), num_classes=ds.num_classes)
    return MultinomialLogReg(ds.num_features, ds.num_classes)
