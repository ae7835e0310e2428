"""The federated data set container, its errors and the partition helpers every loader shares.

:class:`FederatedDataset` holds per-client train and test arrays and a JSON description of how
they were made. The loaders (:mod:`fl_examples.core.data` for the synthetic recipes and the
scikit-learn sets, :mod:`fl_examples.core.leaf`, :mod:`fl_examples.core.idx`) build it from
here, so none of them imports another.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from privkit import _validate as v
from privkit.errors import InvalidParameterError, PrivkitError

__all__ = [
    "DataFormatError", "FederatedDataset", "PaddedClients", "Split", "class_assignment",
    "partition_by_classes", "partition_iid", "from_partition", "TRAIN_FRACTION",
    "POOLED_HELDOUT",
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
        description: JSON-able dict (recipe, parameters, seed, preset, assumptions); its
            ``heldout`` entry says where the held-out set comes from.
        x_heldout, y_heldout: the **public held-out set** (None: the data set has none):
            records that no client of the population holds, on which a private run may
            evaluate without spending privacy (:mod:`fl_examples.core.release`). The loaders
            make it from records held back from every client's share of a common pool (the
            pooled test split of digits, breast cancer and MNIST) or from further clients
            drawn by the same recipe (synthetic data); LEAF has none (its test rows belong to
            the training users).

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
    x_heldout: np.ndarray | None = None
    y_heldout: np.ndarray | None = None

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
        if (self.x_heldout is None) != (self.y_heldout is None):
            raise InvalidParameterError("x_heldout", "one of x_heldout / y_heldout",
                                        "both given or neither")
        if self.x_heldout is not None:
            hx, hy = _client_arrays("heldout", self.x_heldout, self.y_heldout, d, c)
            if len(hy) == 0:
                raise InvalidParameterError("x_heldout", "no rows", "at least one row, or None")
            set_(self, "x_heldout", hx)
            set_(self, "y_heldout", hy)
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
        heldout: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> FederatedDataset:
        """Build from one ``(x_train, y_train, x_test, y_test)`` tuple per client (and the
        public held-out set, if any)."""
        x_tr, y_tr, x_te, y_te = (tuple(t[j] for t in splits) for j in range(4))
        hx, hy = heldout if heldout is not None else (None, None)
        return cls(
            tuple(client_ids), x_tr, y_tr, x_te, y_te, num_features, num_classes, description,
            hx, hy,
        )

    @property
    def has_heldout(self) -> bool:
        """Whether a public held-out set exists (:attr:`x_heldout`)."""
        return self.x_heldout is not None

    def heldout_padded(self, rows: int = 256) -> PaddedClients:
        """The held-out set as :class:`PaddedClients` of ``rows`` records each (the last one
        padded), so that it evaluates in chunks like the clients' data.

        Raises:
            InvalidParameterError: the data set has no held-out set.
        """
        if self.x_heldout is None or self.y_heldout is None:
            raise InvalidParameterError("dataset", self.description.get("recipe"),
                                        "a data set with a public held-out set")
        n = len(self.y_heldout)
        k = -(-n // rows)
        x = np.zeros((k * rows, self.num_features), dtype=np.float32)
        y = np.zeros(k * rows, dtype=np.int64)
        x[:n], y[:n] = self.x_heldout, self.y_heldout
        mask = np.arange(k * rows) < n
        sizes = np.minimum(rows, np.maximum(0, n - rows * np.arange(k))).astype(np.int64)
        return PaddedClients(x.reshape(k, rows, -1), y.reshape(k, rows), mask.reshape(k, rows),
                             sizes)

    def with_pooled_test_heldout(self, note: str) -> FederatedDataset:
        """This data set whose held-out set is every client's test split pooled: for loaders
        whose test rows are held back from a common pool (never a client's own records).
        ``note`` says so in ``description['heldout']``."""
        import dataclasses

        x, y = self.pooled(Split.TEST)
        if len(y) == 0:
            return self
        return dataclasses.replace(self, x_heldout=x, y_heldout=y,
                                   description=dict(self.description) | {"heldout": note})

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
    ).with_pooled_test_heldout(POOLED_HELDOUT)


POOLED_HELDOUT = (
    "the test split pooled: the 10% of every client's share of the pool that the loader holds "
    "back (no client holds or trains on these records); public"
)
"""``description['heldout']`` of the loaders whose held-out set is the pooled test split."""
