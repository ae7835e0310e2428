"""SCFL's methods, batch samplers and configuration (saved in the report)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from fl_examples.core.canaries import check_count, refusal
from fl_examples.core.run import below_one, check_shared_settings
from privkit import _validate
from privkit.accountants.midp import LabelMode
from privkit.errors import InvalidParameterError

__all__ = ["ScflMethod", "BatchSampling", "ScflConfig"]


class ScflMethod(enum.Enum):
    """SCFL and the baselines of the paper's section 4 (privkit definitions)."""

    SCFL = "scfl"
    SCFL_NO_MAKEUP = "scfl-nomakeup"
    FL_PMA = "fl-pma"
    CODEDFEDL_STYLE = "codedfedl"
    DP_CFL_STYLE = "dp-cfl"
    CFL_FB = "cfl-fb"

    @property
    def coded(self) -> bool:
        return self is not ScflMethod.FL_PMA

    @property
    def uses_client_gradients(self) -> bool:
        """Whether clients send gradients (all but DP-CFL, which trains on coded data only)."""
        return self is not ScflMethod.DP_CFL_STYLE


class BatchSampling(enum.Enum):
    """FIXED_SIZE: exactly b rows without replacement; BERNOULLI: each row w.p. b/l."""

    FIXED_SIZE = "fixed"
    BERNOULLI = "bernoulli"


def _enum(cls: Any, name: str, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    for m in cls:
        if value in (m.value, m.name):
            return m
    raise InvalidParameterError(name, value, "one of " + ", ".join(m.value for m in cls))


@dataclass(frozen=True)
class ScflConfig:
    """A run's settings (saved in the report).

    Attributes:
        dataset: ``digits[:K|:iid]`` (K classes per client, default 5), ``linreg[:D,O[,NOISE]]``
            (synthetic linear regression, continuous targets) or ``mnist:DIR`` (IDX files, IID).
        clients: n, number of clients.
        num_coded_rows: c; stddev: sigma (absolute, >= 0; the same for every client);
        label_stddev: sigma_y (None: sigma); 0 or ``label_mode="paper_noiseless"``: the paper's
            noiseless labels.
        label_l2_bound: clipping bound of continuous targets (one-hot: 1).
        kappa: weight of the client part, in [0, 1].
        deadline: T in simulated seconds (None: the slowest client's minimum time, so every
            client has p_i >= 1 - p_l,i); fb_deadline: CFL-FB's T_FB (None: the same rule with
            full batches).
        server_batch_size: b_s; client_batch_size: b (b_i = min(b, l_i)).
        batch_sampling: FIXED_SIZE (default) or BERNOULLI (compute time at the nominal b_i).
        lr: step size in units of 1/(m rho^2), a public bound on 1/lambda_max(X^T X):
            eta = lr / (m rho^2) with rho = 1 (rows are scaled into the unit ball).
        rounds: R epochs (with ``time_budget``: at most R).
        time_budget: simulated seconds; when set, every method runs until its simulated
            clock reaches it (or ``rounds``), so methods compare at equal simulated time.
        l2_reg: lambda >= 0 of an optional ridge term (lambda/2)||W||^2 added to f for every
            method (gradient + lambda W); 0 (default) is the paper's problem. With a finite
            coded set the server part's Hessian (1/c) X~^T X~ - (sum sigma_i^2) I is
            indefinite when c is not >> d, so long runs can drift in low-curvature directions;
            lambda above that negative curvature keeps every method convex.
        psi: FL-PMA's dropped fraction in [0, 1); makeup: DP-CFL's g_o.
        output: ``average`` (the paper's (1/R) sum W^(r)) or ``last``: the model the history's
            train_loss / accuracies describe (both are always reported).
        n_mac: MACs per sample (None: 2 d o); mac_rate: fastest client's MAC/s;
            compute_spread: fastest/slowest MAC-rate ratio (log-uniform over clients);
            server_mac_rate: MACR_s; uplink_rate: fastest uplink (bit/s); uplink_spread;
            erasure_min/erasure_max: p_l,i uniform in this range; downlink_rate (bit/s);
            bits_per_param: gradient and model encoding.
        secure_coding: draw G and the noise from the OS CSPRNG (not reproducible).
        secure_noise: everything the guarantees rest on from the OS CSPRNG: the coding (as
            ``secure_coding``) and, with gradient noise, the clients' Poisson batches and the
            noise (otherwise a seeded simulation).
        eval_client_data: with gradient noise, also evaluate on the clients' training data
            (listed as not covered by the epsilon); by default a private run evaluates on the
            held-out set (the test rows, which no client trains on) only.
        gradient_noise_multiplier: z of record-level DP on the per-epoch client gradients
            (None: the gradients carry no noise, the paper's setting): each example's
            gradient ``x_j (x_j^T W - y_j)^T`` is clipped to ``gradient_clip``, the sum gets
            N(0, (z C)^2), minibatches are Poisson (``batch_sampling="bernoulli"``, rate
            b_i / l_i); each client is charged ``PoissonSampledDpEvent(q_i,
            GaussianDpEvent(z))`` per epoch on a ledger, under add or remove one record.
        gradient_noise_for_epsilon: calibrate z so that every client's epsilon after
            ``rounds`` epochs is at most this (instead of ``gradient_noise_multiplier``).
        gradient_clip: C, the per-example clip norm of the gradient noise.
        delta: the delta of the gradients' epsilon.
        audit_canaries: with gradient noise, M > 0 plants M white-box canary records in one
            client's gradients (the first gradient-sending method's; the client with the
            largest sampling rate) and audits them against that client's epsilon
            (:mod:`fl_examples.core.canaries`).
    """

    dataset: str = "digits"
    clients: int = 20
    num_coded_rows: int = 500
    stddev: float = 1.0
    label_stddev: float | None = None
    label_mode: str = "noisy"
    label_l2_bound: float = 1.0
    kappa: float = 0.5
    deadline: float | None = None
    fb_deadline: float | None = None
    server_batch_size: int = 64
    client_batch_size: int = 16
    batch_sampling: str = "fixed"
    lr: float = 1.0
    rounds: int = 300
    time_budget: float | None = None
    l2_reg: float = 0.0
    psi: float = 0.0
    makeup: bool = True
    output: str = "average"
    seed: int = 0
    eval_every: int = 1
    checkpoint_every: int = 0
    n_mac: float | None = None
    mac_rate: float = 2e5
    compute_spread: float = 4.0
    server_mac_rate: float = 2e7
    uplink_rate: float = 2e5
    uplink_spread: float = 4.0
    erasure_min: float = 0.1
    erasure_max: float = 0.5
    downlink_rate: float = 2e6
    bits_per_param: int = 32
    secure_coding: bool = False
    secure_noise: bool = False
    eval_client_data: bool = False
    gradient_noise_multiplier: float | None = None
    gradient_noise_for_epsilon: float | None = None
    gradient_clip: float = 1.0
    delta: float = 1e-5
    audit_canaries: int = 0

    @property
    def gradient_dp(self) -> bool:
        """Whether the client gradients carry record-level DP noise."""
        return self.gradient_noise_multiplier is not None \
            or self.gradient_noise_for_epsilon is not None

    def __post_init__(self) -> None:
        v = _validate
        v.positive_int("clients", self.clients)
        v.positive_int("num_coded_rows", self.num_coded_rows)
        v.nonnegative("stddev", self.stddev)
        if self.label_stddev is not None:
            v.nonnegative("label_stddev", self.label_stddev)
        if _enum(LabelMode, "label_mode", self.label_mode) is LabelMode.NONE:
            raise InvalidParameterError("label_mode", self.label_mode, "noisy or paper_noiseless")
        v.positive("label_l2_bound", self.label_l2_bound)
        k = v.real("kappa", self.kappa)
        if not 0 <= k <= 1:
            raise InvalidParameterError("kappa", self.kappa, "in [0, 1]")
        for name in ("deadline", "fb_deadline"):
            if getattr(self, name) is not None:
                v.positive(name, getattr(self, name))
        v.positive_int("server_batch_size", self.server_batch_size)
        v.positive_int("client_batch_size", self.client_batch_size)
        _enum(BatchSampling, "batch_sampling", self.batch_sampling)
        v.positive_int("rounds", self.rounds)
        if self.time_budget is not None:
            v.positive("time_budget", self.time_budget)
        v.nonnegative("l2_reg", self.l2_reg)
        below_one("psi", self.psi)
        if self.output not in ("average", "last"):
            raise InvalidParameterError("output", self.output, "average or last")
        check_shared_settings(self)  # lr, seed, eval/checkpoint grid
        if self.n_mac is not None:
            v.positive("n_mac", self.n_mac)
        for name in ("mac_rate", "server_mac_rate", "uplink_rate", "downlink_rate"):
            v.positive(name, getattr(self, name))
        for name in ("compute_spread", "uplink_spread"):
            if not v.positive(name, getattr(self, name)) >= 1:
                raise InvalidParameterError(name, getattr(self, name), ">= 1")
        lo, hi = v.real("erasure_min", self.erasure_min), v.real("erasure_max", self.erasure_max)
        if not (0 <= lo <= hi < 1):
            raise InvalidParameterError("erasure_min/erasure_max", (lo, hi),
                                        "0 <= erasure_min <= erasure_max < 1")
        v.positive_int("bits_per_param", self.bits_per_param)
        v.positive("gradient_clip", self.gradient_clip)
        if self.eval_client_data and not self.gradient_dp:
            raise InvalidParameterError(
                "eval_client_data", True, "given only with gradient noise "
                "(--noise-multiplier or --noise-for-epsilon): without it "
                "the client gradients are unprotected and every metric is published anyway")
        if self.gradient_noise_multiplier is not None:
            v.positive("gradient_noise_multiplier", self.gradient_noise_multiplier)
            if self.gradient_noise_for_epsilon is not None:
                raise InvalidParameterError(
                    "gradient_noise_for_epsilon", self.gradient_noise_for_epsilon,
                    "given without gradient_noise_multiplier (one sets the other)")
        if self.gradient_noise_for_epsilon is not None:
            v.positive("gradient_noise_for_epsilon", self.gradient_noise_for_epsilon)
        m = check_count(self.audit_canaries, checkpoint_every=self.checkpoint_every)
        if m and not self.gradient_dp:
            raise refusal(m, "without gradient noise (--noise-multiplier or --noise-for-epsilon):"
                          " the coded upload's MI-DP is not an epsilon to audit (privkit audit "
                          "coded audits it)")
        if self.gradient_dp and _enum(BatchSampling, "batch_sampling", self.batch_sampling) \
                is not BatchSampling.BERNOULLI:
            raise InvalidParameterError(
                "batch_sampling", self.batch_sampling,
                "bernoulli with gradient noise (Poisson minibatches: the accounting's "
                "amplification assumes them)")
