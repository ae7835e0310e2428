"""Upcycled-FL's configuration, the even step's extrapolation and the model choice."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fl_examples.core.applies import check_and_resolve, refuse_together
from fl_examples.core.data import FederatedDataset
from fl_examples.core.deep_models import CNN
from fl_examples.core.distributed import check_aggregation, check_dropout_tolerance
from fl_examples.core.models import MLP, MultinomialLogReg
from fl_examples.core.privacy import (
    PRIVACY_KINDS,
    logreg_lipschitz,
    logreg_smoothness,
)
from fl_examples.core.run import (
    below_one,
    check_shared_settings,
    float32_scale,
    target_within_budget,
)
from privkit import _validate
from privkit.errors import InvalidParameterError

ALGORITHMS = ("upcycled", "fedprox", "fedavg")

_PRIVATE = ("output", "objective", "client", "record")
SENSITIVITY_NAMES = ("replace-one", "paper", "strongly-convex")

#: Which privacy model uses each privacy setting (anything else is refused, by name).
APPLIES: dict[str, tuple[str, ...]] = {
    "sensitivity": ("output",), "l2_clip_norm": ("output", "client", "record"),
    "stddev": ("output",), "alpha": ("objective",), "lipschitz": ("output",),
    "feature_norm": ("output",), "noise_multiplier": ("client", "record"),
    "client_rate": ("client",), "server_lr": ("client",), "server_momentum": ("client",),
    "adaptive_clip": ("client",), "delta": _PRIVATE, "epsilon_budget": _PRIVATE,
    "noise_for_epsilon": _PRIVATE, "noise_target": ("output", "objective", "record"),
    "allow_unproven": ("objective",), "secure_noise": _PRIVATE,
    "eval_client_data": _PRIVATE, "mechanism": ("client",), "bands": ("client",),
    "participation": ("client",), "groups": ("client",),
    "min_separation": ("client",), "aggregation": ("client",), "bits": ("client",),
    "min_survivors": ("client",), "colluders": ("client",),
    "dropout_tolerance": ("client",),
}
#: The defaults of the privacy settings, filled for the models that use them.
DEFAULTS: dict[str, Any] = {
    "sensitivity": "replace-one", "stddev": 1.0, "alpha": 20.0,
    "noise_multiplier": 1.0, "server_lr": 1.0, "noise_target": "max",
    "mechanism": "gaussian", "aggregation": "central",
}
#: The client-level defaults that depend on the mechanism, filled for the settings left out.
#: DP-FedAvg (``gaussian``): the clip norm tracks the median update norm (adaptive clipping,
#: Andrew et al. 2021; ``l2_clip_norm`` is then the initial C, ``adaptive_clip=0`` keeps it
#: fixed) and the server applies the noisy mean with heavy-ball momentum 0.5 (learning rate 1).
#: Banded MF (``bandmf``): a fixed clip norm (its sensitivity is for one) and no momentum (its
#: strategy is optimised for the prefix sums plain server steps accumulate).
#: docs/trainers/private_utility.md measures them (bench/private_utility.py).
CLIENT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gaussian": {"adaptive_clip": 0.5, "server_momentum": 0.5},
    "bandmf": {"server_momentum": 0.0},
}
#: The secure sum's modulus exponent of ``--aggregation distributed`` when ``--bits`` is left
#: out (TensorFlow Federated's default; docs/mechanisms/distributed_dp.md measures 12 to 20).
DEFAULT_BITS = 20
#: Client-level mechanisms: ``gaussian`` (DP-FedAvg, Poisson sampling) and ``bandmf``
#: (banded matrix factorization, :mod:`fl_examples.core.banded`).
MECHANISMS = ("gaussian", "bandmf")
WHY = {
    "noise_target": "client-level DP has one epsilon, the population's",
    "noise_multiplier": "output perturbation sets its noise with --sigma, objective "
                        "perturbation with --alpha",
    "stddev": "client and record levels set their noise with --noise-multiplier",
}


@dataclass(frozen=True)
class UpcycledConfig:
    """Everything a run needs; saved in the report so the run can be repeated.

    Attributes:
        dataset: a dataset spec (see :func:`fl_examples.core.data.parse_dataset_spec`).
        model: ``logreg`` (multinomial logistic regression), ``mlp`` (784-196-10 shape),
            ``cnn`` (the paper's FEMNIST CNN: 3x3 conv, 3 channels, linear 1000 and 100) or
            ``lstm`` (Sent140: embedding 300, 2 x LSTM 128; needs token ids, ``sent140tok:DIR``).
        mu: FedProx proximal coefficient (>= 0).
        lam: lambda of the even step (> 0 unless mu = 0); c = mu / (mu + lambda_m).
        lam_schedule: ``constant`` (lambda_m = lam, the paper's experiments) or ``sqrt``
            (lambda_m = lam sqrt(m), c_m = O(1/sqrt(m)) as in Corollary 4.8).
        iterations: Upcycled-FL iterations (odd + even); baselines run half as many rounds
            in a comparison, as in the paper (80/80/160).
        fraction: share of clients sampled per data round, in (0, 1].
        stragglers: share of the sampled clients that run fewer epochs, in [0, 1).
        local_epochs, batch_size, lr, momentum: the local solver (paper: E = 20, lr = 0.05,
            momentum 0.5).
        seed: root of the seed tree shared by all algorithms.
        device: ``auto``, ``cpu`` or ``cuda``.
        eval_every: evaluate every this many iterations (and at the last one).
        checkpoint_every: checkpoint every this many iterations (0 = never).
        privacy: ``none``, ``output`` (clip the uploaded model to ``l2_clip_norm`` and add
            N(0, ``stddev``^2) on odd iterations), ``objective`` (a linear term with density
            ~ exp(-``alpha`` ||n||) in the local objective on odd iterations), ``client``
            (client-level DP-FedAvg: Poisson client sampling at ``client_rate``, each update
            clipped to ``l2_clip_norm``, N(0, (``noise_multiplier`` C)^2) on the sum) or
            ``record`` (record-level DP-SGD in local training: Poisson minibatches of expected
            size ``batch_size``, per-example gradients clipped to ``l2_clip_norm``,
            ``noise_multiplier`` on each step). See :mod:`fl_examples.core.dp_modes`.
        sensitivity: output perturbation's sensitivity: ``replace-one`` (2 tau, default),
            ``paper`` (tau/|D_i|, Thm C.1's assumption, reported NOT PROVEN) or
            ``strongly-convex`` (needs ``feature_norm``, momentum 0, logreg and
            lr <= 2/(beta + 2 mu)).
        feature_norm: R, the public L2 bound every feature row is clipped to
            (``strongly-convex``): it gives u1 = sqrt(2 (R^2 + 1)) and beta = (R^2 + 1)/2.
        lipschitz: u1 for ``strongly-convex`` (default: the one ``feature_norm`` implies; a
            smaller value is refused, a larger one is used as given).
        delta: the delta every epsilon is reported at (default: the paper's 1e-3 for
            ``output``/``objective``, 1e-5 for ``client``/``record``).
        noise_multiplier: z of ``client`` and ``record`` (noise stddev over the clip norm; at
            ``client`` with adaptive clipping, the sum's: the round is priced at the joint z).
        client_rate: q of ``client``: each client joins a data round with this probability
            (default: ``fraction``).
        server_lr, server_momentum: the server optimiser of ``client`` (DP-FedAvg), applied
            to the noisy mean update (default: learning rate 1, momentum 0.5 with
            ``gaussian`` and 0 with ``bandmf``; :data:`CLIENT_DEFAULTS`).
        adaptive_clip: ``client`` with ``gaussian``: the quantile of the update norms the clip
            norm tracks from ``l2_clip_norm`` (adaptive clipping, Andrew et al. 2021; default
            0.5; 0 keeps the clip norm fixed). Its noisy count (stddev
            :func:`~fl_examples.core.dp_modes.adaptive_count_stddev`) and the sum are one
            release per round, priced jointly: :meth:`privkit.AdaptiveClipping.round_event`.
        epsilon_budget: per-client budget; the run stops before a client would exceed it.
        allow_unproven: run objective perturbation although Thm C.2 does not hold here (SGD is
            not an exact minimiser); its epsilon is then marked NOT PROVEN.
        noise_for_epsilon: calibrate ``stddev`` (output), ``alpha`` (objective) or
            ``noise_multiplier`` (client, record) so that the run ends at this epsilon (the
            clients' max by default, ``noise_target``); refused together with the setting it
            calibrates, and above ``epsilon_budget``.
        noise_target: ``max`` (default) or ``mean``: which per-client epsilon
            ``noise_for_epsilon`` targets (output, objective, record; client level has one).
        baseline_iterations: iterations of the baselines in a comparison: ``half`` (the same
            number of data rounds, as in the paper's Table 1), ``same`` (the same number of
            iterations, as in its privacy experiments: FedProx then leaks twice as often), or
            ``auto`` (half without privacy, same with).
        secure_noise: draw the client sampling, minibatch sampling and noise from the OS
            CSPRNG instead of the seed (a private run is otherwise a seeded simulation).
        eval_client_data: a private run also evaluates on the clients' training and test data
            (those metrics are listed as not covered by its epsilon).
        mechanism: ``client`` only: ``gaussian`` (DP-FedAvg: independent noise, Poisson
            client sampling) or ``bandmf`` (correlated noise from a banded matrix
            factorization under ``participation``; :mod:`fl_examples.core.banded`).
        bands: ``bandmf``: b, the strategy's bands (default 4; 1 is DP-FedAvg's noise under
            the same participation).
        participation: ``bandmf``: ``minsep`` (cohorts of round(q N) among clients not in
            the last b - 1 data rounds; default), ``cyclic`` (group t mod g, every member)
            or ``poisson`` (group t mod g, each member with probability q; amplified).
        groups: ``bandmf`` with ``cyclic`` or ``poisson``: g, the groups (default: bands).
        min_separation: ``bandmf`` with ``minsep``: s, data rounds between two participations
            of a client (default: bands).
        audit_canaries: ``client`` only: M > 0 plants M white-box canary clients in the main
            algorithm's releases and audits the run (:mod:`fl_examples.core.canaries`;
            under ``distributed`` encoded like a client, without a noise share, in the secure
            sum).
        aggregation: ``client`` only: ``central`` (default: DP-FedAvg, the server adds the
            noise) or ``distributed`` (no trusted aggregator: each client adds a Skellam
            noise share and the server learns the sum modulo 2^bits through secure
            aggregation; :mod:`fl_examples.core.distributed`). Not with ``bandmf`` or adaptive
            clipping.
        bits: ``distributed``: the secure sum's modulus exponent (default
            :data:`DEFAULT_BITS`).
        min_survivors: ``distributed``: the fewest clients a released sum may hold; a data
            round with a smaller cohort is skipped, releasing and charging nothing (default:
            the largest n with P(cohort < n) <= 1%, N at client rate 1).
        colluders: ``distributed``: clients that may collude with the server (their noise
            shares are not counted; default 0).
        dropout_tolerance: ``distributed``: f in [0, 1], each released round's noise shares
            are calibrated for ``max(min_survivors, ceil((1 - f) n))`` survivors of its n
            clients (default 0: the simulation has no dropouts, a released sum carries the
            priced noise; 1: every client adds the share for min_survivors, the fixed-share
            protocol; a deployment that tolerates dropouts sets f).

    The privacy settings left at None take their model's default (:data:`DEFAULTS`); one
    given for a model that does not use it is refused (:data:`APPLIES`), so the recorded
    configuration holds what the run used.
    """

    dataset: str = "synthetic:0.5,0.5"
    model: str = "logreg"
    mu: float = 1.0
    lam: float = 0.42
    lam_schedule: str = "constant"
    iterations: int = 160
    fraction: float = 0.3
    stragglers: float = 0.9
    local_epochs: int = 20
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.5
    seed: int = 0
    device: str = "auto"
    eval_every: int = 1
    checkpoint_every: int = 0
    privacy: str = "none"
    sensitivity: str | None = None
    l2_clip_norm: float | None = None
    stddev: float | None = None
    alpha: float | None = None
    lipschitz: float | None = None
    feature_norm: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    client_rate: float | None = None
    server_lr: float | None = None
    server_momentum: float | None = None
    adaptive_clip: float | None = None
    epsilon_budget: float | None = None
    allow_unproven: bool = False
    noise_for_epsilon: float | None = None
    noise_target: str | None = None
    baseline_iterations: str = "auto"
    secure_noise: bool = False
    eval_client_data: bool = False
    mechanism: str | None = None
    bands: int | None = None
    participation: str | None = None
    groups: int | None = None
    min_separation: int | None = None
    audit_canaries: int = 0
    aggregation: str | None = None
    bits: int | None = None
    min_survivors: int | None = None
    colluders: int | None = None
    dropout_tolerance: float | None = None

    def __post_init__(self) -> None:
        float32_scale("mu", self.mu, allow_zero=True)
        float32_scale("lam", self.lam, allow_zero=True)
        if self.mu > 0 and not self.lam > 0:
            raise InvalidParameterError("lam", self.lam, "> 0 when mu > 0")
        if self.lam_schedule not in ("constant", "sqrt"):
            raise InvalidParameterError("lam_schedule", self.lam_schedule, "constant or sqrt")
        if self.model not in ("logreg", "mlp", "cnn", "lstm"):
            raise InvalidParameterError("model", self.model, "logreg, mlp, cnn or lstm")
        _validate.positive_int("iterations", self.iterations)
        _validate.probability("fraction", self.fraction)
        below_one("stragglers", self.stragglers)
        below_one("momentum", self.momentum)
        if self.privacy not in PRIVACY_KINDS:
            raise InvalidParameterError("privacy", self.privacy,
                                        "none, output, objective, client or record")
        # a setting given for a privacy model that does not use it is an error (never
        # dropped); then the model's defaults fill what was left out
        for first in ("stddev", "alpha", "noise_multiplier"):
            refuse_together(self, first, "noise_for_epsilon", "which calibrates it")
        calibrated = {"output": "stddev", "objective": "alpha", "client": "noise_multiplier",
                      "record": "noise_multiplier"}.get(self.privacy)
        fill = {k: v for k, v in DEFAULTS.items()
                if not (self.noise_for_epsilon is not None and k == calibrated)}
        check_and_resolve(self, self.privacy, APPLIES, fill, why=WHY)
        if self.l2_clip_norm is None and self.privacy in APPLIES["l2_clip_norm"]:
            # the paper's tau for output perturbation; a unit clip for DP-FedAvg and DP-SGD
            object.__setattr__(self, "l2_clip_norm", 10.0 if self.privacy == "output" else 1.0)
        if self.sensitivity != "strongly-convex":
            for name in ("lipschitz", "feature_norm"):
                if getattr(self, name) is not None:
                    raise InvalidParameterError(name, getattr(self, name),
                                                "given only with --sensitivity strongly-convex")
        if self.delta is None and self.privacy != "none":  # the mode's default, recorded
            object.__setattr__(self, "delta", 1e-5 if self.privacy in ("client", "record")
                               else 1e-3)
        check_shared_settings(self)  # local solver, delta, budget, seed, eval/checkpoint grid
        for name in ("noise_multiplier", "l2_clip_norm", "stddev", "alpha", "server_lr"):
            if getattr(self, name) is not None:
                _validate.positive(name, getattr(self, name))
        if self.client_rate is not None:
            q = _validate.positive("client_rate", self.client_rate)
            if not q <= 1:
                raise InvalidParameterError("client_rate", self.client_rate, "in (0, 1]")
        if self.server_momentum is not None:
            below_one("server_momentum", self.server_momentum)
        if self.adaptive_clip is not None:
            a = _validate.real("adaptive_clip", self.adaptive_clip)
            if not 0 <= a < 1:
                raise InvalidParameterError("adaptive_clip", self.adaptive_clip,
                                            "a quantile in (0, 1), or 0 for a fixed clip norm")
        target_within_budget("noise_for_epsilon", self.noise_for_epsilon, self.epsilon_budget)
        if self.noise_target is not None and self.noise_target not in ("mean", "max"):
            raise InvalidParameterError("noise_target", self.noise_target, "mean or max")
        if self.sensitivity is not None and self.sensitivity not in SENSITIVITY_NAMES:
            raise InvalidParameterError("sensitivity", self.sensitivity,
                                        f"one of {', '.join(SENSITIVITY_NAMES)}")
        if self.privacy == "objective" and not self.mu > 0:
            raise InvalidParameterError("mu", self.mu, "> 0 for objective perturbation")
        if self.lipschitz is not None:
            _validate.positive("lipschitz", self.lipschitz)
        if self.feature_norm is not None:
            _validate.positive("feature_norm", self.feature_norm)
        if self.privacy == "output" and self.sensitivity == "strongly-convex":
            self._check_strongly_convex()
        self._check_aggregation()
        self._check_mechanism()
        check_audit(self.audit_canaries, self.privacy, self.checkpoint_every)
        if self.baseline_iterations not in ("auto", "half", "same"):
            raise InvalidParameterError("baseline_iterations", self.baseline_iterations,
                                        "auto, half or same")

    def _check_aggregation(self) -> None:
        """``aggregation`` and the settings only distributed DP uses: refused where they do
        not apply, with the mechanism and adaptive clipping they conflict with."""
        own = ("bits", "min_survivors", "colluders", "dropout_tolerance")
        if not check_aggregation(self.aggregation, {n: getattr(self, n) for n in own}):
            return  # central, or not client level (None: its settings are refused by name)
        if self.mechanism == "bandmf":
            raise InvalidParameterError(
                "aggregation", self.aggregation, "central with --mechanism bandmf (banded MF's "
                "correlated noise comes from the server's secret noise state; clients cannot "
                "add independent shares of it)")
        if self.adaptive_clip:
            raise InvalidParameterError(
                "adaptive_clip", self.adaptive_clip, "left out (or 0) with --aggregation "
                "distributed (adaptive clipping's count would need its own secure sum and "
                "noise shares; the clip norm --clip is fixed)")
        object.__setattr__(self, "adaptive_clip", 0.0)
        bits = DEFAULT_BITS if self.bits is None else self.bits
        object.__setattr__(self, "bits", _validate.positive_int("bits", bits))
        if not 2 <= self.bits <= 62:
            raise InvalidParameterError("bits", self.bits, "an integer in [2, 62]")
        if self.min_survivors is not None:
            object.__setattr__(self, "min_survivors", _validate.positive_int(
                "min_survivors", self.min_survivors))
        colluders = 0 if self.colluders is None else self.colluders
        object.__setattr__(self, "colluders", _validate.nonnegative_int("colluders", colluders))
        if self.min_survivors is not None and self.colluders >= self.min_survivors:
            raise InvalidParameterError("colluders", self.colluders,
                                        f"< --min-survivors {self.min_survivors} (at least "
                                        "one honest noise share)")
        f = 0.0 if self.dropout_tolerance is None else self.dropout_tolerance
        object.__setattr__(self, "dropout_tolerance", check_dropout_tolerance(f))

    def _check_mechanism(self) -> None:
        """The client-level mechanism and the settings only banded MF uses."""
        if self.mechanism is None:
            return
        if self.mechanism not in MECHANISMS:
            raise InvalidParameterError("mechanism", self.mechanism, "gaussian or bandmf")
        banded = ("bands", "participation", "groups", "min_separation")
        if self.mechanism == "gaussian":
            for name in banded:
                if getattr(self, name) is not None:
                    raise InvalidParameterError(name, getattr(self, name),
                                                "given only with --mechanism bandmf")
            self._fill(CLIENT_DEFAULTS["gaussian"])
            return
        self._fill(CLIENT_DEFAULTS["bandmf"])
        if self.adaptive_clip:
            raise InvalidParameterError("adaptive_clip", self.adaptive_clip,
                                        "left out with --mechanism bandmf (its sensitivity "
                                        "is for a fixed clip norm)")
        if self.bands is None:
            object.__setattr__(self, "bands", 4)
        object.__setattr__(self, "bands", _validate.positive_int("bands", self.bands))
        if self.participation is None:
            object.__setattr__(self, "participation", "minsep")
        if self.participation not in ("minsep", "cyclic", "poisson"):
            raise InvalidParameterError("participation", self.participation,
                                        "minsep, cyclic or poisson")
        if self.groups is not None:
            if self.participation == "minsep":
                raise InvalidParameterError("groups", self.groups, "given only with "
                                            "--participation cyclic or poisson")
            object.__setattr__(self, "groups", _validate.positive_int("groups", self.groups))
        if self.min_separation is not None:
            if self.participation != "minsep":
                raise InvalidParameterError("min_separation", self.min_separation, "given "
                                            "only with --participation minsep")
            object.__setattr__(self, "min_separation",
                               _validate.positive_int("min_separation", self.min_separation))
        if self.participation == "cyclic" and self.client_rate is not None:
            raise InvalidParameterError("client_rate", self.client_rate, "left out with "
                                        "--participation cyclic (every member of the "
                                        "round's group takes part)")

    def _fill(self, defaults: dict[str, Any]) -> None:
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    @property
    def effective_client_rate(self) -> float:
        """q of ``client`` (``client_rate``, else ``fraction``)."""
        return self.fraction if self.client_rate is None else self.client_rate

    def _check_strongly_convex(self) -> None:
        """The strongly convex bound's conditions, enforced (not taken on trust)."""
        r = self.feature_norm
        if r is None:
            raise InvalidParameterError(
                "feature_norm", None, "given with --sensitivity strongly-convex: every feature "
                "row is clipped to this public L2 norm R, which bounds the per-example gradient "
                "(--lipschitz) by sqrt(2 (R^2 + 1))")
        u1 = logreg_lipschitz(r)
        if self.lipschitz is not None and self.lipschitz < u1:
            raise InvalidParameterError(
                "lipschitz", self.lipschitz, f">= {u1:.6g} = sqrt(2 (R^2 + 1)), the per-example "
                f"gradient bound of logistic regression on features clipped to --feature-norm "
                f"{r:g}")
        bound = 2.0 / (logreg_smoothness(r) + 2.0 * self.mu) if self.mu > 0 else 0.0
        if self.mu > 0 and not self.lr <= bound:
            raise InvalidParameterError(
                "lr", self.lr, f"<= 2/(beta + 2 mu) = {bound:.6g} for --sensitivity "
                f"strongly-convex (contracting steps; beta = (R^2 + 1)/2 = "
                f"{logreg_smoothness(r):.6g})")

    @property
    def lipschitz_bound(self) -> float | None:
        """u1 the strongly convex bound uses (given, or implied by ``feature_norm``)."""
        if self.lipschitz is not None:
            return self.lipschitz
        return None if self.feature_norm is None else logreg_lipschitz(self.feature_norm)


def check_audit(m: int, privacy: str, checkpoint_every: int) -> None:
    """``audit_canaries`` (``--audit-canaries``): client level only; the others refused in one
    line saying why (:mod:`fl_examples.core.canaries`)."""
    from fl_examples.core.canaries import check_count, refusal

    n = check_count(m, checkpoint_every=checkpoint_every)
    why = {
        "none": "without --privacy (a non-private run has no accounted epsilon to audit)",
        "record": "with --privacy record (record-level DP-SGD runs inside each client, "
                  "privkit.torch.ClientsDpSgd: its noisy steps are never released and it "
                  "takes no extra per-example gradients; audit DP-SGD with "
                  "privkit.torch.make_private and DpSgd.step(extra_gradients=), "
                  "docs/audit-runs.md)",
        "output": "with --privacy output (each client releases its own noisy model, no "
                  "sum: a canary would only re-test the Gaussian mechanism, which privkit "
                  "audit gaussian does)",
        "objective": "with --privacy objective (the noise is in each client's own "
                     "objective, no released sum to plant a canary in: privkit audit "
                     "objective audits the mechanism)"}
    if n and privacy in why:
        raise refusal(n, why[privacy])


def extrapolation(cfg: UpcycledConfig, m: int) -> float:
    """c_m = mu / (mu + lambda_m) for the m-th even step (m >= 1)."""
    if cfg.mu == 0:
        return 0.0
    lam = cfg.lam * (math.sqrt(m) if cfg.lam_schedule == "sqrt" else 1.0)
    return cfg.mu / (cfg.mu + lam)


def _model(cfg: UpcycledConfig, ds: FederatedDataset) -> Any:
    if cfg.model == "mlp":
        return MLP(ds.num_features, 196, ds.num_classes)
    if cfg.model == "cnn":
        side = math.isqrt(ds.num_features)
        if side * side != ds.num_features:
            raise InvalidParameterError("model", "cnn", "used with square images (e.g. 28x28 "
                                        f"FEMNIST/MNIST or 8x8 digits), not {ds.num_features} "
                                        "features")
        return CNN(image_size=side, channels=3, hidden=(1000, 100), num_classes=ds.num_classes)
    if cfg.model == "lstm":
        from fl_examples.core.deep_models import StackedLSTM

        vocab_size = ds.description.get("vocab_size")
        if vocab_size is None:
            raise InvalidParameterError("model", "lstm", "used with token-id features (e.g. "
                                        "sent140tok:DIR), not a data set without vocab_size")
        return StackedLSTM(vocab_size=vocab_size, embedding_dim=300, hidden=128, layers=2,
                           num_classes=ds.num_classes, seq_len=ds.num_features)
    return MultinomialLogReg(ds.num_features, ds.num_classes)
