"""Federated data sets: the container, FedProx synthetic data, splits and the CLI grammar.

Every generator takes an explicit :class:`numpy.random.Generator` (or an ``int`` seed that is
turned into one with :func:`numpy.random.default_rng`) and returns a :class:`FederatedDataset`
whose ``description`` says, as JSON, how it was made. Nothing downloads: real LEAF and MNIST
files come from a directory the user supplies (:mod:`fl_examples.core.leaf`,
:mod:`fl_examples.core.idx`) and the small offline sets come with scikit-learn.

Spec: ``shared/spec/data.md``.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from privkit import _validate as v
from privkit.errors import InvalidParameterError, PrivkitError

__all__ = [
    "DataFormatError", "FederatedDataset", "PaddedClients", "Split", "SyntheticPreset",
    "synthetic", "class_assignment", "partition_by_classes", "partition_iid", "from_partition",
    "digits", "breast_cancer", "parse_dataset_spec", "DATASET_SPEC_FORMS",
]  # fmt: skip

TRAIN_FRACTION = 0.9
"""Each client's shuffled pairs: the first ``int(0.9 * n)`` train, the rest test (FedProx)."""


class DataFormatError(PrivkitError):
    """A data file is malformed; the message names the file and the offending key.

    ``key`` is a JSON key path such as ``user_data['f_00001'].x`` or an IDX header field such
    as ``magic``; ``path``, ``key`` and ``problem`` are kept as attributes.
    """

    def __init__(self, path: str | Path, key: str, problem: str) -> None:
        self.path, self.key, self.problem = str(path), key, problem
        super().__init__(f"{self.path}: {key}: {problem}")


class Split(enum.Enum):
    """Which half of every client's data."""

    TRAIN = "train"
    TEST = "test"


class PaddedClients(NamedTuple):
    """Clients stacked on a leading axis, padded to a common length.

    Attributes:
        x: float32 features, shape (clients, length, num_features); padding rows are 0.
        y: int64 labels, shape (clients, length); padding entries are 0.
        mask: bool, shape (clients, length); True on real samples.
        sizes: int64 number of real samples per client, shape (clients,).
    """

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    sizes: np.ndarray


def _client_arrays(where: str, x: Any, y: Any, d: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.ascontiguousarray(x, dtype=np.float32)
    x = x.reshape(0, d) if x.size == 0 else x
    y = np.ascontiguousarray(y, dtype=np.float64 if len(y) == 0 else None)
    if x.ndim != 2 or x.shape[1] != d:
        raise InvalidParameterError(f"x_{where}.shape", x.shape, f"(n, {d})")
    if not np.isfinite(x).all():
        raise InvalidParameterError(f"x_{where}", "non-finite entries", "finite")
    if y.shape != (len(x),) or y.dtype.kind not in "iuf":
        raise InvalidParameterError(f"y_{where}.shape", y.shape, f"({len(x)},), numeric")
    ok = np.isfinite(y) & (y >= 0) & (y < c)
    yi = np.where(ok, y, 0).astype(np.int64)
    if not (ok.all() and np.all(yi == y)):
        raise InvalidParameterError(f"y_{where}", y, f"integers in [0, {c})")
    return x, yi


def _split(split: Split | str) -> Split:
    try:
        return Split(split)
    except ValueError:
        raise InvalidParameterError("split", split, "Split.TRAIN or Split.TEST") from None


@dataclass(frozen=True)
class FederatedDataset:
    """Per-client train and test arrays plus a JSON description of how they were made.

    Features are converted to float32 arrays of shape (n_i, num_features) and labels to int64
    arrays of shape (n_i,) with values in ``[0, num_classes)``. A client may hold no test data;
    the whole data set must hold at least one training sample.

    Attributes:
        client_ids: one id per client.
        x_train, y_train, x_test, y_test: one array per client (tuples, indexable by client).
        num_features: feature dimension d.
        num_classes: number of classes C.
        description: JSON-able dict (recipe, parameters, seed, preset, assumptions).

    Example:
        >>> import numpy as np
        >>> ds = FederatedDataset(("a", "b"), [np.zeros((3, 2)), np.ones((1, 2))],
        ...                       [np.array([0, 1, 1]), np.array([1])],
        ...                       [np.zeros((1, 2)), np.zeros((0, 2))], [np.array([0]), []],
        ...                       num_features=2, num_classes=2)
        >>> ds.num_clients, ds.train_sizes.tolist(), ds.weights.tolist()
        (2, [3, 1], [0.75, 0.25])
        >>> ds.padded().mask.tolist()
        [[True, True, True], [True, False, False]]
    """

    client_ids: tuple[str, ...]
    x_train: tuple[np.ndarray, ...]
    y_train: tuple[np.ndarray, ...]
    x_test: tuple[np.ndarray, ...]
    y_test: tuple[np.ndarray, ...]
    num_features: int
    num_classes: int
    description: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d = v.positive_int("num_features", self.num_features)
        c = v.positive_int("num_classes", self.num_classes)
        ids = tuple(str(i) for i in self.client_ids)
        k = len(ids)
        if k == 0:
            raise InvalidParameterError("client_ids", self.client_ids, "non-empty")
        if len(set(ids)) != k:
            raise InvalidParameterError("client_ids", self.client_ids, "unique")
        set_ = object.__setattr__
        set_(self, "client_ids", ids)
        set_(self, "num_features", d)
        set_(self, "num_classes", c)
        for split in ("train", "test"):
            xs, ys = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if len(xs) != k or len(ys) != k:
                raise InvalidParameterError(f"x_{split}", len(xs), f"one array per client ({k})")
            pairs = [_client_arrays(f"{split}[{i}]", *xy, d, c) for i, xy in enumerate(zip(xs, ys))]
            set_(self, f"x_{split}", tuple(p[0] for p in pairs))
            set_(self, f"y_{split}", tuple(p[1] for p in pairs))
        if self.train_sizes.sum() == 0:
            raise InvalidParameterError("x_train", "no samples", "at least one training sample")
        try:
            json.dumps(self.description, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidParameterError("description", exc, "JSON-serialisable") from None

    @classmethod
    def from_splits(
        cls,
        client_ids: Sequence[str],
        splits: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        *,
        num_features: int,
        num_classes: int,
        description: dict[str, Any],
    ) -> FederatedDataset:
        """Build from one ``(x_train, y_train, x_test, y_test)`` tuple per client."""
        x_tr, y_tr, x_te, y_te = (tuple(t[j] for t in splits) for j in range(4))
        return cls(
            tuple(client_ids), x_tr, y_tr, x_te, y_te, num_features, num_classes, description
        )

    @property
    def num_clients(self) -> int:
        """Number of clients K."""
        return len(self.client_ids)

    @property
    def train_sizes(self) -> np.ndarray:
        """int64 array of n_i, the training samples per client."""
        return np.array([len(y) for y in self.y_train], dtype=np.int64)

    @property
    def test_sizes(self) -> np.ndarray:
        """int64 array of test samples per client."""
        return np.array([len(y) for y in self.y_test], dtype=np.int64)

    @property
    def weights(self) -> np.ndarray:
        """float64 aggregation weights p_i = n_i / sum_j n_j (training sizes); they sum to 1."""
        n = self.train_sizes.astype(np.float64)
        return n / n.sum()

    def _arrays(self, split: Split | str) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        s = _split(split)
        return (self.x_train, self.y_train) if s is Split.TRAIN else (self.x_test, self.y_test)

    def label_counts(self, split: Split | str = Split.TRAIN) -> np.ndarray:
        """int64 matrix (clients x classes) of label counts."""
        _, ys = self._arrays(split)
        return np.stack([np.bincount(y, minlength=self.num_classes) for y in ys])

    def label_distribution(self, split: Split | str = Split.TRAIN) -> np.ndarray:
        """float64 matrix (clients x classes); row i is client i's label frequencies.

        Rows sum to 1, except that a client without samples in ``split`` gets a row of zeros.
        """
        counts = self.label_counts(split).astype(np.float64)
        totals = counts.sum(axis=1, keepdims=True)
        return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)

    def pooled(self, split: Split | str = Split.TRAIN) -> tuple[np.ndarray, np.ndarray]:
        """All clients' ``split`` data concatenated in client order: (x, y)."""
        xs, ys = self._arrays(split)
        return np.concatenate(xs), np.concatenate(ys)

    def padded(
        self,
        split: Split | str = Split.TRAIN,
        *,
        clients: Sequence[int] | None = None,
        pad_to: int | None = None,
    ) -> PaddedClients:
        """Stack clients on a leading axis, padded with zeros to a common length.

        Args:
            split: which half.
            clients: indices of the clients to stack, in this order (default: all).
            pad_to: common length; default the largest selected client. Must not be smaller.

        Returns:
            :class:`PaddedClients` of numpy arrays (a trainer moves them to torch). Memory is
            ``len(clients) * pad_to * num_features`` floats, so heavy-tailed sizes cost.
        """
        xs, ys = self._arrays(split)
        idx = list(range(self.num_clients)) if clients is None else [int(i) for i in clients]
        for i in idx:
            if not 0 <= i < self.num_clients:
                raise InvalidParameterError("clients", i, f"indices in [0, {self.num_clients})")
        sizes = np.array([len(ys[i]) for i in idx], dtype=np.int64)
        longest = int(sizes.max()) if len(idx) else 0
        length = longest if pad_to is None else v.nonnegative_int("pad_to", pad_to)
        if length < longest:
            raise InvalidParameterError("pad_to", pad_to, f">= the largest client ({longest})")
        x = np.zeros((len(idx), length, self.num_features), dtype=np.float32)
        y = np.zeros((len(idx), length), dtype=np.int64)
        mask = np.zeros((len(idx), length), dtype=bool)
        for row, (i, n) in enumerate(zip(idx, sizes)):
            x[row, :n], y[row, :n], mask[row, :n] = xs[i], ys[i], True
        return PaddedClients(x, y, mask, sizes)


# ---------------------------------------------------------------------------------------------
# Randomness and splitting helpers


def _rng(rng: np.random.Generator | int) -> tuple[np.random.Generator, int | None]:
    """Return (generator, seed or None). ``None`` is refused: it would seed from the OS."""
    if isinstance(rng, np.random.Generator):
        return rng, None
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) and rng >= 0:
        return np.random.default_rng(int(rng)), int(rng)
    raise InvalidParameterError("rng", rng, "a numpy.random.Generator or an int seed >= 0")


def _train_test(
    x: np.ndarray, y: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle one client's pairs; the first ``int(0.9 * n)`` train, the rest test."""
    perm = rng.permutation(len(y))
    tr, te = perm[: int(TRAIN_FRACTION * len(y))], perm[int(TRAIN_FRACTION * len(y)) :]
    return x[tr], y[tr], x[te], y[te]


def partition_iid(num_samples: int, num_clients: int, *, rng: np.random.Generator) -> list:
    """Shuffle ``range(num_samples)`` and cut it into ``num_clients`` near-equal index arrays."""
    n = v.positive_int("num_samples", num_samples)
    k = v.positive_int("num_clients", num_clients)
    return [np.sort(p) for p in np.array_split(rng.permutation(n), k)]


def class_assignment(
    num_clients: int, num_classes: int, classes_per_client: int, *, rng: np.random.Generator
) -> np.ndarray:
    """Which classes each client holds: "k classes per client" label skew.

    The classes are permuted once with ``rng``; client i then holds the sliding window
    ``perm[(i + j) % C]`` for ``j < k``. Every client holds exactly k distinct classes, and if
    ``num_clients >= C`` every class is held by ``floor`` or ``ceil`` of ``K * k / C`` clients.

    Returns:
        int64 array of shape (num_clients, classes_per_client).
    """
    k_clients = v.positive_int("num_clients", num_clients)
    c = v.positive_int("num_classes", num_classes)
    k = v.positive_int("classes_per_client", classes_per_client)
    if k > c:
        raise InvalidParameterError("classes_per_client", k, f"<= num_classes ({c})")
    perm = rng.permutation(c)
    return perm[(np.arange(k_clients)[:, None] + np.arange(k)[None, :]) % c].astype(np.int64)


def partition_by_classes(
    labels: np.ndarray, assignment: np.ndarray, *, rng: np.random.Generator
) -> list:
    """Deal each class's samples, shuffled, in near-equal parts to the clients that hold it.

    Samples of a class no client holds are left out. Returns sorted index arrays, one per row
    of ``assignment`` (see :func:`class_assignment`).
    """
    labels = np.asarray(labels)
    parts: list[list[np.ndarray]] = [[] for _ in range(len(assignment))]
    for c in np.unique(labels):
        holders = np.flatnonzero((assignment == c).any(axis=1))
        if len(holders) == 0:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for h, chunk in zip(holders, np.array_split(idx, len(holders))):
            parts[h].append(chunk)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def from_partition(
    x: np.ndarray,
    y: np.ndarray,
    parts: Sequence[np.ndarray],
    *,
    rng: np.random.Generator,
    num_classes: int,
    description: dict[str, Any],
) -> FederatedDataset:
    """Build a data set from pooled arrays and per-client index arrays; ids ``c_00000``, ...

    Each client's share is shuffled and split 90/10 (first ``int(0.9 n)`` train).
    """
    data = [_train_test(x[p], y[p], rng) for p in parts]
    ids = [f"c_{i:05d}" for i in range(len(parts))]
    return FederatedDataset.from_splits(
        ids, data, num_features=x.shape[1], num_classes=num_classes, description=description
    )


# ---------------------------------------------------------------------------------------------
# FedProx synthetic data


class SyntheticPreset(enum.Enum):
    """Shapes of the FedProx synthetic recipe (spec ``data.md`` section 2).

    - ``FEDPROX``: 60 features, 10 classes, as in the FedProx scripts.
    - ``UPCYCLED_PAPER``: 20 features, 10 classes, as the Upcycled-FL paper describes.
    - ``UPCYCLED_RELEASED_SHAPE``: 20 features, 2 classes, the shape of Upcycled-FL's released
      files. Their label mechanism is unknown; this preset *assumes* the FedProx recipe with
      ``NUM_CLASS = 2`` and says so in the description.
    """

    FEDPROX = "fedprox"
    UPCYCLED_PAPER = "upcycled_paper"
    UPCYCLED_RELEASED_SHAPE = "upcycled_released_shape"

    @property
    def num_features(self) -> int:
        """Feature dimension of the preset."""
        return 60 if self is SyntheticPreset.FEDPROX else 20

    @property
    def num_classes(self) -> int:
        """Number of classes of the preset."""
        return 2 if self is SyntheticPreset.UPCYCLED_RELEASED_SHAPE else 10


def synthetic(
    model_heterogeneity_std: float,
    data_heterogeneity_std: float,
    *,
    rng: np.random.Generator | int,
    num_clients: int = 30,
    num_features: int | None = None,
    num_classes: int | None = None,
    preset: SyntheticPreset = SyntheticPreset.UPCYCLED_PAPER,
    iid: bool = False,
) -> FederatedDataset:
    """FedProx Synthetic(alpha, beta) (Li et al. 2020, ``generate_synthetic.py``).

    For each client k: ``n_k = int(lognormal(4, 2)) + 50``; ``u_k ~ N(0, alpha)``,
    ``B_k ~ N(0, beta)`` (alpha, beta are standard deviations, as in the authors' code);
    ``v_k ~ N(B_k, 1)^d``; ``W_k ~ N(u_k, 1)^(d x C)``, ``b_k ~ N(u_k, 1)^C``;
    ``x ~ N(v_k, Sigma)`` with ``Sigma = diag((j+1)^-1.2)`` (variances);
    ``y = argmax(x @ W_k + b_k)`` (= argmax softmax). Each client's pairs are shuffled and the
    first ``int(0.9 n_k)`` are train, so every client has >= 45 training samples.

    With ``iid=True`` (``generate_iid.py``): ``v_k = 0`` and one global ``W, b ~ N(0, 1)``
    shared by every client; alpha and beta have no role there and must be 0.

    The scripts set no seed, so their files cannot be regenerated bit for bit; this reproduces
    the distribution from one explicit generator.

    Args:
        model_heterogeneity_std: alpha (FedProx), a standard deviation >= 0.
        data_heterogeneity_std: beta (FedProx), a standard deviation >= 0.
        rng: a numpy Generator, or an int seed (recorded in the description).
        num_clients: K (30 in the papers).
        num_features: d; default from ``preset``.
        num_classes: C; default from ``preset``.
        preset: shape preset (default Upcycled-FL paper: d = 20, C = 10).
        iid: the ``generate_iid.py`` variant.

    Returns:
        A :class:`FederatedDataset` with ids ``f_00000``, ``f_00001``, ...

    Example:
        >>> ds = synthetic(0.5, 0.5, rng=0)
        >>> ds.num_clients, ds.num_features, ds.num_classes, int(ds.train_sizes.min()) >= 45
        (30, 20, 10, True)
    """
    alpha = v.nonnegative("model_heterogeneity_std", model_heterogeneity_std)
    beta = v.nonnegative("data_heterogeneity_std", data_heterogeneity_std)
    gen, seed = _rng(rng)
    k_clients = v.positive_int("num_clients", num_clients)
    if not isinstance(preset, SyntheticPreset):
        raise InvalidParameterError("preset", preset, "a SyntheticPreset")
    d = preset.num_features if num_features is None else num_features
    c = preset.num_classes if num_classes is None else num_classes
    d, c = v.positive_int("num_features", d), v.positive_int("num_classes", c)
    if c < 2:
        raise InvalidParameterError("num_classes", c, "an integer >= 2")
    if not isinstance(iid, bool):
        raise InvalidParameterError("iid", iid, "a bool")
    if iid and (alpha != 0 or beta != 0):
        raise InvalidParameterError(
            "model_heterogeneity_std/data_heterogeneity_std", (alpha, beta), "0 when iid=True"
        )

    # Draw order follows the scripts: sizes, priors, feature means, models, then samples.
    sizes = gen.lognormal(4.0, 2.0, k_clients).astype(np.int64) + 50
    std_x = np.sqrt(np.power(np.arange(1, d + 1, dtype=np.float64), -1.2))
    if iid:
        means_x = np.zeros((k_clients, d))
        w_global = gen.normal(0.0, 1.0, (d, c))
        b_global = gen.normal(0.0, 1.0, c)
    else:
        mean_w = gen.normal(0.0, alpha, k_clients)  # u_k, also the mean of b_k
        big_b = gen.normal(0.0, beta, k_clients)
        means_x = np.stack([gen.normal(big_b[i], 1.0, d) for i in range(k_clients)])
    data = []
    for i in range(k_clients):
        if iid:
            w, b = w_global, b_global
        else:
            w = gen.normal(mean_w[i], 1.0, (d, c))
            b = gen.normal(mean_w[i], 1.0, c)
        # Sigma is diagonal, so N(v, Sigma) is v + sqrt(diag) * N(0, I), exactly.
        x = means_x[i] + std_x * gen.standard_normal((int(sizes[i]), d))
        y = np.argmax(x @ w + b, axis=1)
        data.append(_train_test(x, y, gen))

    assumptions = [
        "alpha and beta are standard deviations (the authors' code), not variances",
        "labels are argmax of the logits, equal to argmax softmax",
        "x drawn as v_k + sqrt(diag(Sigma)) * N(0, I), equal in law to multivariate_normal",
        "distribution reproduced from one explicit Generator; the scripts set no seed",
    ]
    if preset is SyntheticPreset.UPCYCLED_RELEASED_SHAPE:
        assumptions.append(
            "Upcycled-FL's released 2-class labels come from an unknown mechanism; this assumes "
            "the FedProx recipe with NUM_CLASS = 2"
        )
    params = dict(model_heterogeneity_std=alpha, data_heterogeneity_std=beta, iid=iid,
                  num_clients=k_clients, num_features=d, num_classes=c,
                  train_fraction=TRAIN_FRACTION)  # fmt: skip
    description = {
        "recipe": "fedprox_synthetic_iid" if iid else "fedprox_synthetic",
        "reference": "litian96/FedProx data/synthetic_*/generate_synthetic.py, generate_iid.py",
        "parameters": params, "preset": preset.value, "seed": seed, "assumptions": assumptions,
    }  # fmt: skip
    ids = [f"f_{i:05d}" for i in range(k_clients)]
    return FederatedDataset.from_splits(
        ids, data, num_features=d, num_classes=c, description=description
    )


# ---------------------------------------------------------------------------------------------
# Offline scikit-learn data


def digits(
    *,
    rng: np.random.Generator | int,
    num_clients: int = 30,
    classes_per_client: int | None = 5,
) -> FederatedDataset:
    """scikit-learn's 8 x 8 digits (1797 x 64, 10 classes) split across clients.

    Pixels (0..16) are divided by 16, so features lie in [0, 1] and ``||x|| <= 8``, a public
    bound. With ``classes_per_client = k`` each client holds k classes
    (:func:`class_assignment`); ``None`` deals the samples IID. Each client's samples are then
    split 90/10. k = 5 mimics Upcycled-FL's FEMNIST setting.

    Example:
        >>> ds = digits(rng=0, classes_per_client=2)
        >>> ds.num_clients, ds.num_features, int((ds.label_counts() > 0).sum(axis=1).max())
        (30, 64, 2)
    """
    from sklearn.datasets import load_digits

    gen, seed = _rng(rng)
    k_clients = v.positive_int("num_clients", num_clients)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    if classes_per_client is None:
        parts = partition_iid(len(y), k_clients, rng=gen)
    else:
        assignment = class_assignment(k_clients, 10, classes_per_client, rng=gen)
        parts = partition_by_classes(y, assignment, rng=gen)
    partition = "iid" if classes_per_client is None else "classes_per_client"
    description = {
        "recipe": "sklearn_digits", "seed": seed,
        "parameters": {"num_clients": k_clients, "classes_per_client": classes_per_client,
                       "partition": partition, "train_fraction": TRAIN_FRACTION},
        "preprocessing": "pixel / 16, in [0, 1]", "feature_l2_bound": 8.0,
        "assumptions": ["sklearn.datasets.load_digits stands in for FEMNIST (no writer ids)"],
    }  # fmt: skip
    return from_partition(x, y, parts, rng=gen, num_classes=10, description=description)


def breast_cancer(*, rng: np.random.Generator | int, num_clients: int = 10) -> FederatedDataset:
    """scikit-learn's breast cancer set (569 x 30, 2 classes), standardised, split IID.

    Features are standardised with the pooled mean and standard deviation of all 569 rows.
    These are data-dependent, so the set suits demos and tests, not privacy claims; there is
    no public norm bound (a DP trainer must clip and record it).

    Example:
        >>> ds = breast_cancer(rng=0)
        >>> ds.num_clients, ds.num_features, int(ds.train_sizes.sum() + ds.test_sizes.sum())
        (10, 30, 569)
    """
    from sklearn.datasets import load_breast_cancer

    gen, seed = _rng(rng)
    k_clients = v.positive_int("num_clients", num_clients)
    x, y = load_breast_cancer(return_X_y=True)
    x = ((x - x.mean(axis=0)) / x.std(axis=0)).astype(np.float32)
    parts = partition_iid(len(y), k_clients, rng=gen)
    description = {
        "recipe": "sklearn_breast_cancer", "seed": seed,
        "parameters": {"num_clients": k_clients, "partition": "iid",
                       "train_fraction": TRAIN_FRACTION},
        "preprocessing": "standardised with the pooled mean and std of all rows",
        "feature_l2_bound": None,
        "assumptions": ["standardisation statistics are data-dependent (not for DP claims)"],
    }  # fmt: skip
    return from_partition(x, y, parts, rng=gen, num_classes=2, description=description)


# ---------------------------------------------------------------------------------------------
# CLI grammar

DATASET_SPEC_FORMS = (
    "synthetic:ALPHA,BETA[:PRESET] | synthetic:iid[:PRESET] (PRESET: paper, fedprox, released) "
    "| digits[:K|:iid] (K classes per client, default 5) | breast_cancer[:CLIENTS] "
    "| leaf:DIR | femnist:DIR | sent140:DIR | sent140tok:DIR | mnist:DIR"
)
"""The accepted forms of :func:`parse_dataset_spec`."""

_PRESETS = {"paper": SyntheticPreset.UPCYCLED_PAPER, "fedprox": SyntheticPreset.FEDPROX,
            "released": SyntheticPreset.UPCYCLED_RELEASED_SHAPE}  # fmt: skip


def _bad(spec: str, detail: str) -> InvalidParameterError:
    return InvalidParameterError("dataset", spec, f"one of {DATASET_SPEC_FORMS} ({detail})")


def _number(spec: str, text: str, *, integer: bool = False) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise _bad(spec, f"{text!r} is not a{'n integer' if integer else ' number'}") from None
    if not (math.isfinite(value) and value >= 0):
        raise _bad(spec, f"{text!r} must be finite and >= 0")
    return value


def parse_dataset_spec(spec: str, *, seed: int) -> FederatedDataset:
    """Build a data set from a CLI string; the seed makes it deterministic.

    Grammar (``DIR`` is everything after the first colon, so it may contain colons):

    - ``synthetic:ALPHA,BETA[:PRESET]``: :func:`synthetic` with those standard deviations,
      e.g. ``synthetic:0.5,0.5``. ``PRESET`` is ``paper`` (default; 20-d, 10 classes),
      ``fedprox`` (60-d, 10 classes) or ``released`` (20-d, 2 classes).
    - ``synthetic:iid[:PRESET]``: the ``generate_iid.py`` variant.
    - ``digits``, ``digits:K``, ``digits:iid``: :func:`digits` over 30 clients, K classes per
      client (default 5) or IID.
    - ``breast_cancer``, ``breast_cancer:CLIENTS``: :func:`breast_cancer` (default 10 clients).
    - ``leaf:DIR``: any LEAF directory, kind detected
      (:func:`fl_examples.core.leaf.load_leaf`); ``femnist:DIR`` keeps the lower-case letters
      'a'-'j' relabelled 0..9 (Upcycled-FL); ``sent140:DIR`` reads Sent140 as a hashed bag
      of words; ``sent140tok:DIR`` reads it as 25 token ids per tweet over a vocabulary of
      the training split (at most 10000 ids; for ``--model lstm``).
    - ``mnist:DIR``: IDX files, IID over 30 clients (:func:`fl_examples.core.idx.load_mnist`).

    Raises:
        InvalidParameterError: naming ``dataset`` for an unknown form or bad number.
        DataFormatError: a LEAF or IDX file is malformed (names the file and key).

    Example:
        >>> parse_dataset_spec("synthetic:1,1:fedprox", seed=3).num_features
        60
    """
    if not isinstance(spec, str):
        raise _bad(repr(spec), "not a string")
    seed = v.nonnegative_int("seed", seed)
    name, _, rest = spec.strip().partition(":")
    name = name.lower()
    if name == "synthetic":
        args = rest.split(":")
        if not rest or len(args) > 2:
            raise _bad(spec, "synthetic needs ALPHA,BETA or iid")
        preset = _PRESETS.get(args[1].lower()) if len(args) == 2 else _PRESETS["paper"]
        if preset is None:
            raise _bad(spec, f"unknown preset {args[1]!r}")
        if args[0].lower() == "iid":
            return synthetic(0.0, 0.0, rng=seed, preset=preset, iid=True)
        pair = args[0].split(",")
        if len(pair) != 2:
            raise _bad(spec, "synthetic needs two numbers ALPHA,BETA")
        alpha, beta = (_number(spec, t) for t in pair)
        return synthetic(alpha, beta, rng=seed, preset=preset)
    if name == "digits":
        if rest.lower() == "iid":
            return digits(rng=seed, classes_per_client=None)
        k = int(_number(spec, rest, integer=True)) if rest else 5
        if not 1 <= k <= 10:
            raise _bad(spec, "digits:K needs 1 <= K <= 10")
        return digits(rng=seed, classes_per_client=k)
    if name == "breast_cancer":
        k = int(_number(spec, rest, integer=True)) if rest else 10
        if not 1 <= k <= 56:
            raise _bad(spec, "breast_cancer:CLIENTS needs 1 <= CLIENTS <= 56")
        return breast_cancer(rng=seed, num_clients=k)
    if name in ("leaf", "femnist", "sent140", "sent140tok", "mnist"):
        if not rest or not Path(rest).is_dir():
            raise _bad(spec, f"{name}:DIR needs an existing directory")
        if name == "mnist":
            from fl_examples.core.idx import load_mnist  # idx imports this module

            return load_mnist(rest, rng=seed)
        from fl_examples.core.leaf import FEMNIST_LOWERCASE_A_TO_J, LeafKind, load_leaf

        if name == "femnist":
            return load_leaf(
                rest, rng=seed, kind=LeafKind.FEMNIST, classes=FEMNIST_LOWERCASE_A_TO_J
            )
        if name == "sent140tok":
            return load_leaf(rest, rng=seed, kind=LeafKind.SENT140_TOKENS)
        kind = LeafKind.SENT140 if name == "sent140" else LeafKind.AUTO
        return load_leaf(rest, rng=seed, kind=kind)
    raise _bad(spec, f"unknown dataset {name!r}")
