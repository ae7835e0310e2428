"""SCFL coded data: one client's one-time upload ``G X + sigma N`` and its MI-DP event.

Client i draws ``G_i`` (c x l_i) and ``N_i`` (c x d), all entries iid N(0, 1), from its own
generator and uploads (Sun et al., "Stochastic Coded Federated Learning with Convergence and
Privacy Guarantees", ISIT 2022)::

    X~_i = G_i X_i + sigma N_i
    Y~_i = G_i Y_i + sigma_y N_y,i      (LabelMode.NOISY, privkit's default; sigma_y = sigma)
    Y~_i = G_i Y_i                      (LabelMode.PAPER_NOISELESS, the paper's scheme)

The server adds the uploads (:func:`sum_uploads`): ``X~ = G X + sigma N`` with
``G = [G_1, ..., G_n]``. Feature rows are clipped to ``row_l2_bound`` (and labels to
``label_l2_bound``) first, so the MI-DP bound of :mod:`privkit.accountants.midp` holds; the
returned :class:`CodedUpload` carries the :class:`~privkit.accountants.midp.CodedDataMiEvent`
that prices it. G and the noise are local variables: never returned, logged or stored.

Label noise keeps the coded gradient unbiased (Y~ enters it only through X~^T Y~ and N_y has
mean zero); without it (``PAPER_NOISELESS``) Y~ = G Y reveals G and the labels, and the
accountant reports +inf (continuous labels) or the full-disclosure bound (one-hot labels).

Randomness: a ``numpy.random.Generator`` (fast mode) or a
:class:`~privkit.mechanisms.sampling.SecureRandom` (secure mode; OS CSPRNG, no seed).
:func:`client_rng` derives a client's generator from ``(seed, client id)`` only, so the coded
rows do not depend on the order in which clients are processed.

Examples:
    >>> import numpy as np
    >>> x = np.eye(3)
    >>> y = np.eye(3)[:, :2]
    >>> up = code_client_data(x, y, num_coded_rows=4, stddev=1.0, row_l2_bound=1.0,
    ...                       categorical_labels=False, label_l2_bound=1.0,
    ...                       rng=client_rng(0, "client-a"))
    >>> up.coded_features.shape, up.coded_labels.shape, up.event.label_mode.name
    ((4, 3), (4, 2), 'NOISY')
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit._rng import RngKind, check_rng
from privkit.errors import InvalidParameterError
from privkit.events import CodedDataMiEvent, LabelMode
from privkit.mechanisms.clipping import clip_per_example

__all__ = ["CodedUpload", "LabelMode", "CodedDataMiEvent", "code_client_data", "client_rng",
           "sum_uploads"]


@dataclass(frozen=True, eq=False)
class CodedUpload:
    """What one client sends once, before training.

    Attributes:
        coded_features: X~_i, shape (c, d), float64 (or the requested dtype).
        coded_labels: Y~_i, shape (c, o); None when no labels were given.
        event: the privacy event of this upload (price it with
            :func:`privkit.accountants.midp.midp_coded_release`).
    """

    coded_features: np.ndarray
    coded_labels: np.ndarray | None
    event: CodedDataMiEvent


def client_rng(seed: int, client_id: str) -> np.random.Generator:
    """A client's coding generator from ``(seed, client_id)`` alone (order independent).

    The id is hashed (SHA-256) into the seed sequence's spawn key. For deployments use a
    :class:`~privkit.mechanisms.sampling.SecureRandom` instead: a seeded G is not secret.
    """
    s = _validate.nonnegative_int("seed", seed)
    if not isinstance(client_id, str) or not client_id:
        raise InvalidParameterError("client_id", client_id, "a non-empty string")
    digest = hashlib.sha256(client_id.encode("utf-8")).digest()
    key = tuple(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4))
    return np.random.default_rng(np.random.SeedSequence(s, spawn_key=(0xC0DE, *key)))


def _matrix(name: str, value: Any, *, floating: bool = False) -> np.ndarray:
    if floating:
        try:
            dt = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
        except (TypeError, ValueError):
            dt = None  # not an array: refused below
        is_float = getattr(dt, "is_floating_point", None)  # a torch dtype
        if dt is not None and not (is_float if is_float is not None else dt.kind == "f"):
            raise InvalidParameterError(f"{name}.dtype", dt, "floating point (features are "
                                        "real numbers; convert integer data deliberately)")
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, value, "a 2-D array of real numbers") from None
    if a.ndim != 2:
        raise InvalidParameterError(f"{name}.shape", a.shape, "2-D (rows, columns)")
    if floating and 0 in a.shape:
        raise InvalidParameterError(f"{name}.shape", a.shape, "at least one row and one column")
    if not np.isfinite(a).all():
        raise InvalidParameterError(name, "non-finite entries", "finite in every entry")
    return a


def _normals(rng: Any, kind: RngKind, shape: tuple[int, int], dtype: Any) -> np.ndarray:
    if kind is RngKind.NUMPY:
        return rng.standard_normal(shape, dtype=dtype)
    return np.asarray(rng.standard_normal(shape), dtype=dtype).reshape(shape)


def code_client_data(
    features: Any,
    labels: Any = None,
    *,
    num_coded_rows: int,
    stddev: float,
    row_l2_bound: float,
    label_mode: LabelMode | str = LabelMode.NOISY,
    label_stddev: float | None = None,
    label_l2_bound: float | None = None,
    categorical_labels: bool = True,
    rng: Any,
    dtype: Any = np.float64,
) -> CodedUpload:
    """Code one client's (X_i, Y_i) into ``num_coded_rows`` rows (SCFL's one-time upload).

    Args:
        features: X_i, shape (l_i, d), finite. Rows are clipped to ``row_l2_bound``.
        labels: Y_i, shape (l_i, o), or None (features only, ``LabelMode.NONE``).
        num_coded_rows: c, an integer >= 1.
        stddev: sigma, absolute stddev of the feature noise, finite and >= 0 (0: no privacy,
            MI-DP = inf).
        row_l2_bound: rho_x > 0, the feature rows' L2 clipping bound (include a bias column).
        label_mode: ``NOISY`` (default) or ``PAPER_NOISELESS``; ignored without labels.
        label_stddev: sigma_y for ``NOISY``; None means sigma. 0 selects the paper's scheme
            (``PAPER_NOISELESS``).
        label_l2_bound: rho_y, labels' L2 clipping bound. Categorical labels: the rows are
            one-hot times rho_y (default 1). Continuous labels in ``NOISY`` mode: required.
        categorical_labels: labels are one-hot rows, times ``label_l2_bound`` if given
            (checked); default True.
        rng: a ``numpy.random.Generator`` or a ``SecureRandom`` (drawn in the order G, N, N_y).
        dtype: float64 (default) or float32 for the coded arrays (numpy generators only).

    Returns:
        A :class:`CodedUpload` with X~_i, Y~_i and the upload's event.

    Raises:
        InvalidParameterError: c <= 0, sigma < 0 or NaN, bad bounds, shapes, no rows,
            integer features, non-finite data,
            labels that are not one-hot when ``categorical_labels``, a torch generator.
    """
    c = _validate.positive_int("num_coded_rows", num_coded_rows)
    sigma = _validate.nonnegative("stddev", stddev)
    rho = _validate.positive("row_l2_bound", row_l2_bound)
    kind = check_rng(rng)
    if kind is RngKind.TORCH:
        raise InvalidParameterError("rng", rng, "a numpy.random.Generator or SecureRandom "
                                    "(coded data is built on the host)")
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
        raise InvalidParameterError("dtype", dtype, "float64 or float32")
    if dt == np.float32 and kind is not RngKind.NUMPY:
        raise InvalidParameterError("dtype", dtype, "float64 in secure mode")
    if not isinstance(categorical_labels, bool):
        raise InvalidParameterError("categorical_labels", categorical_labels, "a bool")
    x = clip_per_example(_matrix("features", features, floating=True), rho)
    mode = LabelMode.NONE if labels is None else _mode(label_mode)
    if mode is LabelMode.NONE and labels is not None:
        raise InvalidParameterError("label_mode", label_mode, "NOISY or PAPER_NOISELESS "
                                    "when labels are given")
    y = None
    sy, ry, o = 0.0, None, 0
    if labels is not None:
        y = _matrix("labels", labels)
        if y.shape[0] != x.shape[0]:
            raise InvalidParameterError("labels.shape", y.shape,
                                        f"({x.shape[0]}, o): one label row per feature row")
        o = y.shape[1]
        if o < 1:
            raise InvalidParameterError("labels.shape", y.shape, "at least one column")
        if categorical_labels:
            ry = 1.0 if label_l2_bound is None else _validate.positive("label_l2_bound",
                                                                       label_l2_bound)
            if not (np.isin(y, (0.0, ry)).all() and ((y == ry).sum(axis=1) == 1).all()):
                raise InvalidParameterError(
                    "labels", "not one-hot", f"one-hot rows (times label_l2_bound = {ry:g}) "
                    "when categorical_labels=True")
        if mode is LabelMode.NOISY:
            sy = sigma if label_stddev is None else _validate.nonnegative(
                "label_stddev", label_stddev)
            if sy == 0:
                mode = LabelMode.PAPER_NOISELESS
        elif label_stddev not in (None, 0, 0.0):
            raise InvalidParameterError("label_stddev", label_stddev,
                                        "None or 0 with PAPER_NOISELESS labels")
        if categorical_labels:
            pass  # ry set above: the rows already have norm ry
        elif label_l2_bound is not None:
            ry = _validate.positive("label_l2_bound", label_l2_bound)
            y = clip_per_example(y, ry)
        elif mode is LabelMode.NOISY:
            raise InvalidParameterError("label_l2_bound", None,
                                        "given for continuous labels with label noise")
        if mode is LabelMode.PAPER_NOISELESS:
            sy = 0.0
    event = CodedDataMiEvent(c, sigma, rho, x.shape[1], mode, sy, ry, o, categorical_labels)

    g = _normals(rng, kind, (c, x.shape[0]), dt)
    noise = _normals(rng, kind, (c, x.shape[1]), dt)
    if sigma != 1.0:
        noise *= dt.type(sigma)
    coded_x = g @ x.astype(dt, copy=False)
    coded_x += noise
    del noise
    coded_y = None
    if y is not None:
        coded_y = g @ y.astype(dt, copy=False)
        if mode is LabelMode.NOISY:
            ny = _normals(rng, kind, (c, o), dt)
            ny *= dt.type(sy)
            coded_y += ny
            del ny
    del g
    return CodedUpload(coded_x, coded_y, event)


def _mode(value: Any) -> LabelMode:
    if isinstance(value, LabelMode):
        return value
    for m in LabelMode:
        if value in (m.name, m.value):
            return m
    raise InvalidParameterError("label_mode", value, "NOISY or PAPER_NOISELESS")


def sum_uploads(uploads: Mapping[str, CodedUpload]) -> tuple[np.ndarray, np.ndarray | None]:
    """The server's coded set ``(sum_i X~_i, sum_i Y~_i)``, added in sorted client-id order.

    The fixed order makes the float sum independent of the order the uploads arrived in.
    """
    if not isinstance(uploads, Mapping) or not uploads:
        raise InvalidParameterError("uploads", uploads, "a non-empty mapping id -> CodedUpload")
    keys = sorted(uploads)
    first = uploads[keys[0]]
    shape_x = first.coded_features.shape
    has_y = first.coded_labels is not None
    for k in keys:
        u = uploads[k]
        if not isinstance(u, CodedUpload):
            raise InvalidParameterError(f"uploads[{k!r}]", u, "a CodedUpload")
        if u.coded_features.shape != shape_x or (u.coded_labels is not None) != has_y or (
                has_y and u.coded_labels.shape != first.coded_labels.shape):  # type: ignore
            raise InvalidParameterError(f"uploads[{k!r}]", u.coded_features.shape,
                                        f"the same shapes as every upload ({shape_x})")
    x = np.array(first.coded_features, dtype=np.float64)
    for k in keys[1:]:
        x += uploads[k].coded_features
    if not has_y:
        return x, None
    y = np.array(first.coded_labels, dtype=np.float64)
    for k in keys[1:]:
        y += uploads[k].coded_labels  # type: ignore[arg-type]
    return x, y
