"""SCFL (stochastic coded federated learning) and its baselines, on a simulated timing model.

Sun, Shao, Li, Mao, Zhang, "Stochastic Coded Federated Learning with Convergence and Privacy
Guarantees", ISIT 2022 (arXiv 2201.10092). Linear regression ``f(W) = (1/2)||X W - Y||_F^2``
(one-hot targets for classification data), gradient ``X^T (X W - Y)``.

* Before training every client uploads once ``X~_i = G_i X_i + sigma_i N_i`` and
  ``Y~_i = G_i Y_i (+ sigma_y N_y)`` (:func:`privkit.mechanisms.coded.code_client_data`); the
  server keeps the sum. Each upload's MI-DP is priced by :mod:`privkit.accountants.midp`.
* Epoch r: client i computes ``g_i = (l_i/b_i) X_B^T (X_B W - Y_B)`` on a batch of b_i rows;
  it arrives iff ``t_i = b_i N_MAC/MACR_i + N_i tau_u,i + t_d <= T`` (N_i geometric
  retransmissions, erasure probability p_l,i). The server computes
  ``g_s = (1/b_s) X^_s^T (X^_s W - Y^_s)`` on b_s coded rows and aggregates
  ``g = kappa sum_i 1{arrived} g_i / p_i + (1 - kappa)(g_s + g_o)``, ``g_o = -(sum_i
  sigma_i^2) W``; ``W <- W - eta g``. The epoch lasts T (simulated seconds).
* Output: the average ``(1/R) sum_{r=1}^R W^(r)`` (the paper's; W^(1) is the initial model);
  the last iterate is reported too.

``p_i(T, b) = 1 - p_l^k`` with ``k = floor((T - t_c(b) - t_d)/tau_u)`` when k >= 1, else 0
(derived). Clients with p_i = 0 can never arrive: they are excluded with a warning (the client
part then misses their share). Baselines (:class:`ScflMethod`) differ from SCFL only in the
named respect; all methods share one seed tree (coding, batches, retransmissions).
kappa = 1/2 by default (paper value not available verbatim).

Run ``privkit train scfl --dataset digits --clients 20 --coded-rows 500 --noise-stddev 1.0
--algorithms scfl,fl-pma,codedfedl,dp-cfl,cfl-fb --rounds 300 --out DIR``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fl_examples.core.report import Column, text_table, write_report
from fl_examples.core.run import TrainerRun, check_shared_settings, checkpoint_dir, drive
from fl_examples.core.seeds import SeedTree
from privkit import _validate
from privkit.accountants.midp import COVERS, LabelMode, midp_coded_release, midp_per_client
from privkit.errors import InvalidParameterError
from privkit.events import event_to_dict
from privkit.ledger import atomic_write_bytes
from privkit.mechanisms.clipping import clip_per_example
from privkit.mechanisms.coded import CodedUpload, client_rng, code_client_data, sum_uploads
from privkit.mechanisms.sampling import SecureRandom

__all__ = ["ScflMethod", "BatchSampling", "ScflConfig", "TimingModel", "RegressionData",
           "load_data", "synthetic_linreg", "client_gradient", "server_gradient",
           "makeup_term", "aggregate", "arrival_probability", "train", "final_table",
           "time_to_loss", "KAPPA_NOTE"]

KAPPA_NOTE = "kappa = 1/2 (paper value not available verbatim)"


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
        p = v.real("psi", self.psi)
        if not 0 <= p < 1:
            raise InvalidParameterError("psi", self.psi, "in [0, 1)")
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


# ------------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class TimingModel:
    """t_i(b) = b n_mac / macr_i + N_i tau_u,i + t_d, N_i ~ Geometric(1 - erasure_i) >= 1.

    Attributes (seconds, MACs, MAC/s): n_mac per sample; macr (per client); macr_server;
    tau_u (one upload attempt, per client); erasure (p_l,i); t_down.
    """

    n_mac: float
    macr: np.ndarray
    macr_server: float
    tau_u: np.ndarray
    erasure: np.ndarray
    t_down: float

    def compute_time(self, batch: Any) -> np.ndarray:
        return np.asarray(batch, dtype=np.float64) * self.n_mac / self.macr

    def server_time(self, batch: int) -> float:
        return float(batch) * self.n_mac / self.macr_server

    def min_time(self, batch: Any) -> np.ndarray:
        """The fastest possible t_i(b): one upload attempt."""
        return self.compute_time(batch) + self.tau_u + self.t_down

    def arrival_probability(self, deadline: float, batch: Any) -> np.ndarray:
        """Closed form p_i(T, b) = 1 - p_l^k, k = floor((T - t_c - t_d)/tau_u), 0 if k < 1."""
        k = self.max_attempts(_validate.positive("deadline", deadline), batch)
        return np.where(k >= 1, 1.0 - self.erasure ** np.maximum(k, 1.0), 0.0)

    def max_attempts(self, deadline: float, batch: Any) -> np.ndarray:
        """k_i: the most upload attempts that still meet the deadline (may be <= 0)."""
        return np.floor((deadline - self.compute_time(batch) - self.t_down) / self.tau_u)

    def draw_attempts(self, rng: np.random.Generator) -> np.ndarray:
        """N_i for every client: geometric number of upload attempts (>= 1)."""
        return rng.geometric(1.0 - self.erasure)

    def times(self, batch: Any, attempts: np.ndarray) -> np.ndarray:
        return self.compute_time(batch) + attempts * self.tau_u + self.t_down


def arrival_probability(deadline: float, compute_s: Any, upload_s: Any, download_s: float,
                        erasure: Any) -> np.ndarray:
    """p_i(T, b) from explicit times (see :meth:`TimingModel.arrival_probability`)."""
    tm = TimingModel(1.0, 1.0 / np.asarray(compute_s, dtype=np.float64), 1.0,
                     np.asarray(upload_s, dtype=np.float64),
                     np.asarray(erasure, dtype=np.float64), float(download_s))
    return tm.arrival_probability(deadline, 1.0)


def _timing(cfg: ScflConfig, n: int, dim: int, outputs: int) -> TimingModel:
    rng = SeedTree(cfg.seed).numpy(0, "timing")
    u_c, u_u, u_e = rng.random(n), rng.random(n), rng.random(n)
    params = dim * outputs * cfg.bits_per_param
    return TimingModel(
        n_mac=float(cfg.n_mac if cfg.n_mac is not None else 2 * dim * outputs),
        macr=cfg.mac_rate * cfg.compute_spread ** (-u_c),
        macr_server=float(cfg.server_mac_rate),
        tau_u=params / (cfg.uplink_rate * cfg.uplink_spread ** (-u_u)),
        erasure=cfg.erasure_min + (cfg.erasure_max - cfg.erasure_min) * u_e,
        t_down=params / cfg.downlink_rate)


# --------------------------------------------------------------------------------- data
@dataclass(frozen=True, eq=False)
class RegressionData:
    """Per-client regression data, rows scaled into the unit ball (bias column included).

    ``x[i]`` (l_i, d) and ``y[i]`` (l_i, o) float64; ``labels[i]`` int class labels (None for
    continuous targets); pooled test set ``x_test``, ``y_test``, ``labels_test``.
    """

    client_ids: tuple[str, ...]
    x: tuple[np.ndarray, ...]
    y: tuple[np.ndarray, ...]
    labels: tuple[np.ndarray, ...] | None
    x_test: np.ndarray
    y_test: np.ndarray
    labels_test: np.ndarray | None
    categorical: bool
    description: dict[str, Any]

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(a) for a in self.x], dtype=np.int64)


def _features(x: np.ndarray, public_bound: float | None) -> np.ndarray:
    """x / B (B public) clipped to norm 1, a bias 1 appended, all / sqrt 2: norm <= 1."""
    x = np.asarray(x, dtype=np.float64) / (public_bound or 1.0)
    x = clip_per_example(x, 1.0) if len(x) else x
    return np.hstack([x, np.ones((len(x), 1))]) / math.sqrt(2.0)


def synthetic_linreg(*, rng: np.random.Generator, num_clients: int, dim: int = 20,
                     outputs: int = 5, noise: float = 0.1) -> tuple[list, list, dict[str, Any]]:
    """Per-client (x, y) train and test arrays of ``y = x W* + e``: a linear-regression task.

    Client i holds 40..160 rows (90% train), x ~ N(m_i, I)/sqrt(2 dim) with a client mean
    m_i ~ N(0, 0.3^2 I) (mild non-IID), W* ~ N(0, 1/outputs), e ~ N(0, noise^2).
    """
    n = _validate.positive_int("clients", num_clients)
    w_star = rng.standard_normal((dim, outputs)) / math.sqrt(outputs)
    train, test = [], []
    for _ in range(n):
        size = int(rng.integers(40, 161))
        x = (rng.normal(0.0, 0.3, dim) + rng.standard_normal((size, dim))) / math.sqrt(2 * dim)
        y = x @ w_star + noise * rng.standard_normal((size, outputs))
        k = int(0.9 * size)
        train.append((x[:k], y[:k]))
        test.append((x[k:], y[k:]))
    desc = {"recipe": "synthetic_linreg", "parameters": {"num_clients": n, "dim": dim,
            "outputs": outputs, "noise": noise}, "feature_l2_bound": None}
    return train, test, desc


def load_data(cfg: ScflConfig) -> RegressionData:
    """The run's data set, preprocessed (unit-ball rows with bias; targets clipped/one-hot)."""
    spec, n = cfg.dataset.strip(), cfg.clients
    name, _, rest = spec.partition(":")
    if name == "linreg":
        parts = rest.split(",") if rest else []
        if len(parts) not in (0, 2, 3):
            raise InvalidParameterError("dataset", spec, "linreg[:D,O[,NOISE]]")
        try:
            d, o = (int(parts[0]), int(parts[1])) if parts else (20, 5)
            noise = float(parts[2]) if len(parts) == 3 else 0.1
        except ValueError:
            raise InvalidParameterError("dataset", spec,
                                        "linreg[:D,O[,NOISE]] with numbers") from None
        if d < 1 or o < 1 or not (math.isfinite(noise) and noise >= 0):
            raise InvalidParameterError("dataset", spec, "D, O >= 1 and NOISE >= 0")
        train, test, desc = synthetic_linreg(rng=SeedTree(cfg.seed).numpy(0, "data"),
                                             num_clients=n, dim=d, outputs=o, noise=noise)
        ys = [clip_per_example(y, cfg.label_l2_bound) for _, y in train]
        yt = clip_per_example(np.vstack([y for _, y in test]), cfg.label_l2_bound)
        return RegressionData(
            tuple(f"c_{i:05d}" for i in range(n)), tuple(_features(x, 1.0) for x, _ in train),
            tuple(ys), None, _features(np.vstack([x for x, _ in test]), 1.0), yt, None, False,
            desc | {"targets": f"continuous, clipped to L2 <= {cfg.label_l2_bound:g}"})
    if name == "digits":
        from fl_examples.core.data import digits

        k = None if rest.lower() == "iid" else (int(rest) if rest.isdigit() else 5)
        if rest and rest.lower() != "iid" and not (rest.isdigit() and 1 <= int(rest) <= 10):
            raise InvalidParameterError("dataset", spec, "digits, digits:K (1..10) or digits:iid")
        ds = digits(rng=cfg.seed, num_clients=n, classes_per_client=k)
    elif name == "mnist":
        from fl_examples.core.idx import load_mnist

        if not rest or not Path(rest).is_dir():
            raise InvalidParameterError("dataset", spec, "mnist:DIR with an existing directory")
        ds = load_mnist(rest, rng=cfg.seed, num_clients=n)
    else:
        raise InvalidParameterError("dataset", spec,
                                    "digits[:K|:iid], linreg[:D,O[,NOISE]] or mnist:DIR")
    bound = ds.description.get("feature_l2_bound")
    eye = np.eye(ds.num_classes)
    return RegressionData(
        ds.client_ids, tuple(_features(x, bound) for x in ds.x_train),
        tuple(eye[y] for y in ds.y_train), tuple(ds.y_train),
        _features(np.vstack(ds.x_test), bound), eye[np.concatenate(ds.y_test)],
        np.concatenate(ds.y_test), True,
        ds.description | {"targets": "one-hot", "num_clients": n})


# ----------------------------------------------------------------------- the gradients
def client_gradient(x: np.ndarray, y: np.ndarray, w: np.ndarray, rows: np.ndarray,
                    scale: float) -> np.ndarray:
    """g_i = scale * X_B^T (X_B W - Y_B) on the rows ``rows`` (scale = l_i / b_i)."""
    xb = x[rows]
    return scale * (xb.T @ (xb @ w - y[rows]))


def server_gradient(cx: np.ndarray, cy: np.ndarray, w: np.ndarray, rows: np.ndarray,
                    batch_size: float) -> np.ndarray:
    """g_s = (1/b_s) X^_s^T (X^_s W - Y^_s) on the coded rows ``rows``."""
    xb = cx[rows]
    return (xb.T @ (xb @ w - cy[rows])) / batch_size


def makeup_term(w: np.ndarray, noise_variance_sum: float) -> np.ndarray:
    """g_o = -(sum_i sigma_i^2) W: removes the coding noise's bias from E[g_s]."""
    return -noise_variance_sum * w


def aggregate(client_grads: Any, arrived: Any, p: Any, g_s: np.ndarray, g_o: np.ndarray,
              kappa: float) -> np.ndarray:
    """g = kappa sum_i 1{arrived_i} g_i / p_i + (1 - kappa)(g_s + g_o).

    ``client_grads`` is (n, d, o) (or a list); clients with p_i = 0 must not have arrived.
    """
    g = np.asarray(client_grads, dtype=np.float64)
    a = np.asarray(arrived, dtype=bool)
    pr = np.asarray(p, dtype=np.float64)
    if (a & ~(pr > 0)).any():
        raise InvalidParameterError("arrived", a.tolist(), "False where p_i = 0")
    weights = np.where(a, 1.0 / np.where(pr > 0, pr, 1.0), 0.0)
    return kappa * np.tensordot(weights, g, axes=1) + (1 - kappa) * (g_s + g_o)


# --------------------------------------------------------------------------------- runs
@dataclass
class _Shared:
    """Everything the methods of one comparison share."""

    cfg: ScflConfig
    data: RegressionData
    timing: TimingModel
    batches: np.ndarray  # nominal b_i
    coded: dict[str, tuple[np.ndarray, np.ndarray, list[Any]]]  # "plain"/"weighted" -> X~, Y~
    noise_var: float  # sum_i sigma_i^2
    eta: float
    x_all: np.ndarray
    y_all: np.ndarray
    labels_all: np.ndarray | None


def _deadline(cfg_value: float | None, timing: TimingModel, batch: np.ndarray,
              ok: np.ndarray) -> float:
    if cfg_value is not None:
        return float(cfg_value)
    # The slowest client's minimum time, nudged up so that its k_i is 1 despite rounding.
    return float(timing.min_time(batch)[ok].max()) * (1 + 1e-9)


def _check_deadline(name: str, deadline: float, timing: TimingModel, batch: np.ndarray,
                    method: ScflMethod, ids: tuple[str, ...]) -> np.ndarray:
    p = timing.arrival_probability(deadline, batch)
    if not (p > 0).any():
        fastest = float(timing.min_time(batch).min())
        raise InvalidParameterError(
            name, deadline, f"at least {fastest:.6g} s, the fastest client's minimum time "
            f"(compute + one upload + download): with this deadline no client can arrive "
            f"({method.value})")
    if not (p > 0).all():
        out = [ids[i] for i in np.flatnonzero(p == 0)]
        warnings.warn(f"{method.value}: {len(out)} client(s) can never meet {name} = "
                      f"{deadline:.4g} s and are excluded from the client part (it is then "
                      f"biased): {', '.join(out)}", stacklevel=3)
    return p


def _code(cfg: ScflConfig, data: RegressionData, weights: np.ndarray | None
          ) -> tuple[np.ndarray, np.ndarray, list[Any]]:
    """Every client's upload (optionally weighted rows, CodedFedL) and the server sum."""
    uploads: dict[str, CodedUpload] = {}
    secure = SecureRandom() if cfg.secure_coding else None
    mode = _enum(LabelMode, "label_mode", cfg.label_mode)
    for i, cid in enumerate(data.client_ids):
        # CodedFedL weights client i's rows by w_i = sqrt(1 - p_i); its bounds scale with w_i
        # (w_i = 0: only noise is uploaded; a tiny positive bound keeps the event valid).
        w = 1.0 if weights is None else float(weights[i])
        bound = max(w, 1e-12)
        rng = secure if secure is not None else client_rng(cfg.seed, cid)
        uploads[cid] = code_client_data(
            data.x[i] * w, data.y[i] * bound if data.categorical else data.y[i] * w,
            num_coded_rows=cfg.num_coded_rows, stddev=cfg.stddev, row_l2_bound=bound,
            label_mode=mode, label_stddev=cfg.label_stddev,
            label_l2_bound=bound * (1.0 if data.categorical else cfg.label_l2_bound),
            categorical_labels=data.categorical, rng=rng)
    cx, cy = sum_uploads(uploads)
    assert cy is not None
    return cx, cy, [uploads[c].event for c in data.client_ids]


class _Run(TrainerRun):
    """One method's run (:class:`~fl_examples.core.run.TrainerRun`): model, running sum,
    simulated clock, history; a step is one epoch. No ledger: the privacy is the coded upload's
    MI-DP, fixed before training."""

    records_ledger = False

    def __init__(self, method: ScflMethod, sh: _Shared) -> None:
        self.method, self.sh, cfg = method, sh, sh.cfg
        self.algorithm, self.cfg = method.value, cfg
        d, o = sh.x_all.shape[1], sh.y_all.shape[1]
        self.w = np.zeros((d, o))
        self.w_sum = np.zeros((d, o))
        self.round = 0
        self.sim_time = 0.0
        self.wall = 0.0
        self.history: list[dict[str, Any]] = []
        self.arrivals: list[int] = []
        self.tree = SeedTree(cfg.seed)
        sizes = sh.data.sizes
        self.has_data = sizes > 0
        if method is ScflMethod.CFL_FB:
            self.batch = sizes.copy()
            self.server_batch = cfg.num_coded_rows
            self.deadline = _deadline(cfg.fb_deadline, sh.timing, self.batch, self.has_data)
            name = "fb_deadline"
        else:
            self.batch = sh.batches
            self.server_batch = min(cfg.server_batch_size, cfg.num_coded_rows)
            self.deadline = _deadline(cfg.deadline, sh.timing, self.batch, self.has_data)
            name = "deadline"
        self.p = np.ones(len(sizes))
        if method in (ScflMethod.SCFL, ScflMethod.SCFL_NO_MAKEUP, ScflMethod.CFL_FB,
                      ScflMethod.CODEDFEDL_STYLE):
            self.p = _check_deadline(name, self.deadline, sh.timing, self.batch, method,
                                     sh.data.client_ids) * self.has_data
        key = "weighted" if method is ScflMethod.CODEDFEDL_STYLE else "plain"
        self.cx, self.cy, self.events = sh.coded[key] if method.coded else (None, None, [])

    # ---------------------------------------------------------------- the run protocol
    @property
    def position(self) -> int:
        return self.round

    def finished(self) -> bool:
        budget = self.cfg.time_budget
        return self.round >= self.cfg.rounds or (budget is not None and self.sim_time >= budget)

    def remaining(self) -> int:
        return self.cfg.rounds - self.round

    def report(self) -> dict[str, Any]:
        sh, method = self.sh, self.method
        entry: dict[str, Any] = {
            "history": self.history, "arrivals_per_round": self.arrivals,
            "deadline_s": self.deadline if method is not ScflMethod.FL_PMA else None,
            "arrival_probability": self.p.tolist(),
            "mean_epoch_s": self.sim_time / max(self.round, 1),
            "excluded_clients": [sh.data.client_ids[i] for i in np.flatnonzero(self.p == 0)],
            "_model": {"average": self.w_sum / max(self.round, 1), "last": self.w}}
        priv = _privacy(self)
        if priv is not None:
            entry["privacy"] = priv
        return entry

    # ---------------------------------------------------------------- one epoch
    def _client_rows(self, rng: np.random.Generator, i: int) -> tuple[np.ndarray, float]:
        size, b = int(self.sh.data.sizes[i]), int(self.batch[i])
        if b >= size:
            return np.arange(size), 1.0
        if _enum(BatchSampling, "batch_sampling", self.sh.cfg.batch_sampling) \
                is BatchSampling.BERNOULLI:
            return np.flatnonzero(rng.random(size) < b / size), size / b
        return rng.choice(size, b, replace=False), size / b

    def _server_rows(self, rng: np.random.Generator) -> tuple[np.ndarray, float]:
        c, b = self.sh.cfg.num_coded_rows, self.server_batch
        if b >= c:
            return np.arange(c), float(c)
        if _enum(BatchSampling, "batch_sampling", self.sh.cfg.batch_sampling) \
                is BatchSampling.BERNOULLI:
            return np.flatnonzero(rng.random(c) < b / c), float(b)
        return rng.choice(c, b, replace=False), float(b)

    def step(self) -> bool:
        start = time.perf_counter()
        sh, cfg, m = self.sh, self.sh.cfg, self.method
        r = self.round + 1
        n = len(sh.data.sizes)
        attempts = sh.timing.draw_attempts(self.tree.numpy(r, "arrivals"))
        t = sh.timing.times(self.batch, attempts)
        rng_b = self.tree.numpy(r, "batches")
        rows = [self._client_rows(rng_b, i) for i in range(n)]  # same draws for every method
        w = self.w
        g_o = makeup_term(w, sh.noise_var)
        g_s = None
        if m.coded:
            srows, bs = self._server_rows(self.tree.numpy(r, "server_batch"))
            g_s = server_gradient(self.cx, self.cy, w, srows, bs)

        def client_sum(arrived: np.ndarray, weights: np.ndarray) -> np.ndarray:
            out = np.zeros_like(w)
            for i in np.flatnonzero(arrived):
                out += weights[i] * client_gradient(sh.data.x[i], sh.data.y[i], w, *rows[i])
            return out

        server_t = sh.timing.server_time(self.server_batch) if m.coded else 0.0
        if m is ScflMethod.FL_PMA:
            k = math.ceil((1 - cfg.psi) * n)
            order = np.lexsort((np.arange(n), t))  # by arrival time, ties by client index
            arrived = np.zeros(n, dtype=bool)
            arrived[order[:k]] = True
            arrived &= self.has_data
            total = sh.data.sizes[arrived].sum()
            g = client_sum(arrived, np.full(n, sh.x_all.shape[0] / max(total, 1)))
            epoch = float(t[order[k - 1]])
        elif m is ScflMethod.DP_CFL_STYLE:
            assert g_s is not None
            arrived = np.zeros(n, dtype=bool)
            g = g_s + (g_o if cfg.makeup else 0.0)
            epoch = server_t
        else:
            assert g_s is not None
            # t_i <= T  <=>  N_i <= k_i; the integer test matches the closed form exactly.
            arrived = (attempts <= sh.timing.max_attempts(self.deadline, self.batch)) \
                & (self.p > 0)
            if m is ScflMethod.CODEDFEDL_STYLE:
                g = client_sum(arrived, np.ones(n)) + g_s
            else:
                client = client_sum(arrived, 1.0 / np.where(self.p > 0, self.p, 1.0))
                make_up = g_o if m is not ScflMethod.SCFL_NO_MAKEUP else 0.0
                g = cfg.kappa * client + (1 - cfg.kappa) * (g_s + make_up)
            epoch = max(self.deadline, server_t)
        if cfg.l2_reg:
            g = g + cfg.l2_reg * w
        self.w_sum += w  # W^(r) enters the average before the update (paper's (1/R) sum)
        self.w = w - sh.eta * g
        self.round = r
        self.sim_time += epoch
        self.arrivals.append(int(arrived.sum()))
        self.wall += time.perf_counter() - start
        return True

    # ------------------------------------------------------------------ evaluation
    def _metrics(self, w: np.ndarray) -> dict[str, float]:
        sh = self.sh
        res = sh.x_all @ w - sh.y_all
        out = {"train_loss": float(0.5 * np.mean(np.sum(res**2, axis=1))),
               "test_loss": float(0.5 * np.mean(np.sum((sh.data.x_test @ w
                                                        - sh.data.y_test) ** 2, axis=1)))}
        if sh.labels_all is not None and sh.data.labels_test is not None:
            out["train_accuracy"] = float(np.mean(np.argmax(sh.x_all @ w, 1) == sh.labels_all))
            out["test_accuracy"] = float(np.mean(np.argmax(sh.data.x_test @ w, 1)
                                                 == sh.data.labels_test))
        else:
            out["train_accuracy"] = out["test_accuracy"] = math.nan
        return out

    def evaluate(self) -> dict[str, Any]:
        avg = self.w_sum / self.round if self.round else self.w
        primary = avg if self.sh.cfg.output == "average" else self.w
        other = self.w if self.sh.cfg.output == "average" else avg
        metrics = self._metrics(primary)
        if not math.isfinite(metrics["train_loss"]):
            raise FloatingPointError(f"{self.method.value}: training diverged at round "
                                     f"{self.round}; lower --lr")
        second = self._metrics(other)
        tag = "last" if self.sh.cfg.output == "average" else "average"
        row = {"iteration": self.round, **metrics,
               **{f"{tag}_{k}": val for k, val in second.items()},
               "simulated_time_s": self.sim_time, "wall_time_s": self.wall,
               "client_compute_s": 0.0,
               "arrivals": self.arrivals[-1] if self.arrivals else 0}
        self.history.append(row)
        return row

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        import torch

        tensors = {"w": torch.from_numpy(self.w), "w_sum": torch.from_numpy(self.w_sum)}
        if self.cx is not None:
            tensors["coded_x"] = torch.from_numpy(np.ascontiguousarray(self.cx))
            tensors["coded_y"] = torch.from_numpy(np.ascontiguousarray(self.cy))
        return tensors, {"arrivals": self.arrivals, "simulated_time_s": self.sim_time,
                         "wall_time_s": self.wall}

    def load_state(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        self.w = tensors["w"].numpy().astype(np.float64)
        self.w_sum = tensors["w_sum"].numpy().astype(np.float64)
        if "coded_x" in tensors:  # the server's copy: clients never code twice
            self.cx = tensors["coded_x"].numpy().astype(np.float64)
            self.cy = tensors["coded_y"].numpy().astype(np.float64)
        self.round = int(state["round"])
        self.arrivals = list(state["arrivals"])
        self.sim_time, self.wall = float(state["simulated_time_s"]), float(state["wall_time_s"])


def _privacy(run: _Run) -> dict[str, Any] | None:
    if not run.events:
        return None
    nats = midp_per_client(run.events)
    first = midp_coded_release(run.events[int(np.argmax(nats))])
    return {"measure": "mi_dp_nats", "mi_dp_nats_mean": float(nats.mean()),
            "mi_dp_nats_max": float(nats.max()), "mi_dp_bits_mean": float(nats.mean()
                                                                          / math.log(2)),
            "per_client": nats.tolist(), "label_mode": first.label_mode.value,
            "labels_fully_disclosed": first.labels_fully_disclosed, "method": first.method,
            "covers": COVERS, "proven": True, "assumptions": list(first.assumptions),
            "implied": "only (0, sqrt(2 nats))-DP; not an epsilon"}


def _setup(cfg: ScflConfig, methods: list[ScflMethod]) -> _Shared:
    data = load_data(cfg)
    d, o = data.x[0].shape[1], data.y[0].shape[1]
    timing = _timing(cfg, len(data.sizes), d, o)
    batches = np.minimum(cfg.client_batch_size, data.sizes)
    m = int(data.sizes.sum())
    coded: dict[str, Any] = {}
    if any(mm.coded and mm is not ScflMethod.CODEDFEDL_STYLE for mm in methods):
        coded["plain"] = _code(cfg, data, None)
    if ScflMethod.CODEDFEDL_STYLE in methods:
        ok = data.sizes > 0
        dl = _deadline(cfg.deadline, timing, batches, ok)
        p = _check_deadline("deadline", dl, timing, batches, ScflMethod.CODEDFEDL_STYLE,
                            data.client_ids)
        coded["weighted"] = _code(cfg, data, np.sqrt(1.0 - p))
    labels = np.concatenate(data.labels) if data.labels is not None else None
    return _Shared(cfg, data, timing, batches, coded, len(data.sizes) * cfg.stddev ** 2,
                   cfg.lr / m, np.vstack(data.x), np.vstack(data.y), labels)


def run_method(method: ScflMethod, sh: _Shared, *, out: Path | None = None,
               resume: bool = False, stop_after: int | None = None) -> dict[str, Any]:
    """Run one method for ``cfg.rounds`` epochs; returns its report entry (and ``_model``)."""
    run = _Run(method, sh)
    drive(run, checkpoints=checkpoint_dir(out, method.value),
          checkpoint_every=sh.cfg.checkpoint_every, eval_every=sh.cfg.eval_every,
          resume=resume, stop_after=stop_after)
    entry = run.report()
    if "privacy" in entry and out is not None:
        body = {"client_ids": list(sh.data.client_ids),
                "mi_dp_nats": entry["privacy"]["per_client"],
                "events": [event_to_dict(e) for e in run.events], "covers": COVERS}
        atomic_write_bytes(out / f"midp-{method.value}.json",
                           json.dumps(body, indent=1).encode("utf-8"))
    return entry


def _methods(names: Any) -> list[ScflMethod]:
    items = names.split(",") if isinstance(names, str) else list(names)
    out = [_enum(ScflMethod, "algorithms", s.strip() if isinstance(s, str) else s)
           for s in items if not isinstance(s, str) or s.strip()]
    if not out:
        raise InvalidParameterError("algorithms", names, "at least one method")
    return list(dict.fromkeys(out))


def train(cfg: ScflConfig, *, algorithms: Any = ("scfl", "fl-pma"), out: str | Path | None = None,
          resume: bool = False) -> dict[str, Any]:
    """Run every method in ``algorithms`` on the same data, coding and timing draws."""
    methods = _methods(algorithms)
    sh = _setup(cfg, methods)
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        out_path.mkdir(parents=True, exist_ok=True)
    results = {m.value: run_method(m, sh, out=out_path, resume=resume) for m in methods}
    t = sh.timing
    config = dataclasses.asdict(cfg) | {
        "algorithms": [m.value for m in methods], "privacy": "coded-mi-dp",
        "dataset_description": sh.data.description, "num_clients": len(sh.data.sizes),
        "num_samples": int(sh.data.sizes.sum()), "dim": int(sh.x_all.shape[1]),
        "outputs": int(sh.y_all.shape[1]), "kappa_note": KAPPA_NOTE,
        "eta": sh.eta, "timing": {"n_mac": t.n_mac, "macr": t.macr.tolist(),
                                  "macr_server": t.macr_server, "tau_u": t.tau_u.tolist(),
                                  "erasure": t.erasure.tolist(), "t_down": t.t_down}}
    target = results.get("fl-pma", {}).get("history", [{}])[-1].get("train_loss")
    for entry in results.values():
        entry["time_to_fl_pma_final_loss_s"] = (time_to_loss(entry["history"], target)
                                                if target is not None else None)
    if out_path is not None:
        write_report(out_path, config, results)
    return {"config": config, "algorithms": results}


def time_to_loss(history: list[dict[str, Any]], target: float) -> float | None:
    """Simulated time of the first evaluation with train_loss <= target (None: never)."""
    for h in history:
        if h["train_loss"] <= target:
            return float(h["simulated_time_s"])
    return None


_COLUMNS = (Column("method", 14), Column("rounds", 6), Column("train loss", 10, ".5f"),
            Column("test acc", 8, ".4f"), Column("sim time s", 10, ".2f"),
            Column("mean arrivals", 13, ".2f"), Column("t to PMA loss", 13),
            Column("MI-DP nats (mean/max)", 22))


def final_table(result: dict[str, Any]) -> str:
    """Final loss, accuracy, simulated time and MI-DP of each method."""
    rows = []
    for name, r in result["algorithms"].items():
        f = r["history"][-1]
        arr = np.mean(r["arrivals_per_round"]) if r["arrivals_per_round"] else 0.0
        ttl = r.get("time_to_fl_pma_final_loss_s")
        p = r.get("privacy")
        mi = (f"{p['mi_dp_nats_mean']:.4g}/{p['mi_dp_nats_max']:.4g}" if p else "- (no upload)")
        if p and p["labels_fully_disclosed"]:
            mi += " [labels disclosed]"
        rows.append((name, f["iteration"], f["train_loss"], f["test_accuracy"],
                     f["simulated_time_s"], arr, "-" if ttl is None else f"{ttl:.2f}", mi))
    lines = text_table(_COLUMNS, rows)
    lines.append(f"\nMI-DP: {COVERS}; implies only (0, sqrt(2 nats))-DP. {KAPPA_NOTE}.")
    return "\n".join(lines)
