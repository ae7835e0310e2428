"""SCFL's regression data: rows scaled into the unit ball with a bias column, targets clipped
(continuous) or one-hot (classification data)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fl_examples.core.seeds import SeedTree
from fl_examples.scfl.config import ScflConfig
from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.mechanisms.clipping import clip_per_example

__all__ = ["RegressionData", "synthetic_linreg", "load_data"]


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
