"""LEAF JSON data (FEMNIST, Sent140, LEAF synthetic) from a user-supplied directory.

Every LEAF file is one JSON object ``{"users": [...], "num_samples": [...], "user_data":
{user: {"x": [...], "y": [...]}}, "hierarchies": [...]}`` (``hierarchies`` optional). A
directory's files are merged in sorted order. Each file is validated: missing keys, a length
that disagrees with ``num_samples``, ragged features or bad labels raise
:class:`~fl_examples.core.data.DataFormatError` naming the file and the key.

Spec: ``shared/spec/data.md`` section 3; reference ``TalwalkarLab/leaf``.
"""

from __future__ import annotations

import enum
import json
import numbers
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fl_examples.core.data import (
    DataFormatError,
    FederatedDataset,
    _rng,
    _train_test,
)
from privkit import _validate as v
from privkit.errors import InvalidParameterError

__all__ = [
    "FEMNIST_LOWERCASE_A_TO_J",
    "LeafKind",
    "LeafUser",
    "hashed_bag_of_words",
    "read_leaf_dir",
    "load_leaf",
]

FEMNIST_LOWERCASE_A_TO_J = tuple(range(36, 46))
"""LEAF FEMNIST ids of 'a'..'j' (digits 0-9, upper case 10-35, lower case 36-61); Upcycled-FL
keeps these ten classes, relabelled 0..9 by ``load_leaf(..., classes=...)``."""

FEMNIST_NUM_FEATURES = 784
FEMNIST_NUM_CLASSES = 62
SENT140_TEXT_INDEX = 4  # x = [tweet_id, date, query, user, text, split]


class LeafKind(enum.Enum):
    """How to turn a LEAF sample into a feature vector.

    - ``AUTO``: inspect the first sample: a Sent140 record (a list whose item 4 is a string)
      is ``SENT140``; a numeric vector of length 784 is ``FEMNIST``; another numeric vector is
      ``NUMERIC``.
    - ``FEMNIST``: 784 floats in [0, 1] (28 x 28, flattened), labels 0..61.
    - ``SENT140``: ``[tweet_id, date, query, user, text, split]`` with labels 0/1; the text is
      featurised by :func:`hashed_bag_of_words`.
    - ``NUMERIC``: fixed-length numeric vectors (e.g. LEAF's synthetic set); the number of
      classes is the largest label + 1.
    """

    AUTO = "auto"
    FEMNIST = "femnist"
    SENT140 = "sent140"
    NUMERIC = "numeric"


class LeafUser(NamedTuple):
    """One user's raw samples and the file they came from."""

    x: list
    y: list
    source: Path


_TOKEN = re.compile(r"[a-z0-9']+")


def hashed_bag_of_words(texts: Sequence[str], num_features: int = 1024) -> np.ndarray:
    """Hashed, L2-normalised bag of words: a simple, deterministic text featuriser.

    Text is lower-cased and split into tokens ``[a-z0-9']+``; token t adds 1 to bucket
    ``crc32(utf-8(t)) mod num_features``; each row is divided by its L2 norm (an empty text
    gives zeros), so every row has norm <= 1. CRC-32 is fixed across processes, unlike
    Python's salted ``hash``. A stand-in for Sent140's GloVe + LSTM pipeline that suits
    logistic regression.

    Example:
        >>> x = hashed_bag_of_words(["good good day", ""], num_features=8)
        >>> x.shape, round(float(np.linalg.norm(x[0])), 6), float(x[1].sum())
        ((2, 8), 1.0, 0.0)
    """
    d = v.positive_int("num_features", num_features)
    out = np.zeros((len(texts), d), dtype=np.float64)
    for row, text in enumerate(texts):
        for token in _TOKEN.findall(text.lower()):
            out[row, zlib.crc32(token.encode("utf-8")) % d] += 1.0
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return np.divide(out, norms, out=out, where=norms > 0).astype(np.float32)


def _read_leaf_file(path: Path) -> dict[str, LeafUser]:
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataFormatError(path, "<json>", f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DataFormatError(path, "<root>", "must be a JSON object")
    for key, typ, kind in (
        ("users", list, "array"),
        ("num_samples", list, "array"),
        ("user_data", dict, "object"),
    ):
        if key not in obj:
            raise DataFormatError(path, key, "missing")
        if not isinstance(obj[key], typ):
            raise DataFormatError(path, key, f"must be a JSON {kind}")
    users, counts, data = obj["users"], obj["num_samples"], obj["user_data"]
    if len(counts) != len(users):
        raise DataFormatError(
            path, "num_samples", f"has {len(counts)} entries for {len(users)} users"
        )
    if not all(isinstance(u, str) for u in users) or len(set(users)) != len(users):
        raise DataFormatError(path, "users", "must be distinct strings")
    if set(data) != set(users):
        extra = sorted(set(data) ^ set(users))[:3]
        raise DataFormatError(path, "user_data", f"keys differ from users (e.g. {extra})")
    out = {}
    for i, (user, n) in enumerate(zip(users, counts)):
        key = f"user_data[{user!r}]"
        record = data[user]
        if not isinstance(record, dict):
            raise DataFormatError(path, key, "must be a JSON object with x and y")
        for field in ("x", "y"):
            if field not in record:
                raise DataFormatError(path, f"{key}.{field}", "missing")
            if not isinstance(record[field], list):
                raise DataFormatError(path, f"{key}.{field}", "must be a JSON array")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise DataFormatError(path, f"num_samples[{i}]", f"must be an integer >= 0, got {n!r}")
        x, y = record["x"], record["y"]
        if not len(x) == len(y) == n:
            raise DataFormatError(
                path, key, f"len(x) = {len(x)}, len(y) = {len(y)} and num_samples[{i}] = {n} differ"
            )
        out[user] = LeafUser(x, y, path)
    return out


def read_leaf_dir(directory: str | Path) -> dict[str, LeafUser]:
    """Read and merge every ``*.json`` LEAF file of ``directory`` (sorted file order).

    Returns:
        ``{user: LeafUser(x, y, source)}`` sorted by user id; samples are still raw JSON.

    Raises:
        InvalidParameterError: the directory has no ``*.json`` file.
        DataFormatError: a file is malformed, or a user appears in two files.
    """
    d = Path(directory)
    files = sorted(p for p in d.glob("*.json") if p.is_file()) if d.is_dir() else []
    if not files:
        raise InvalidParameterError("directory", str(d), "a directory holding LEAF *.json files")
    users: dict[str, LeafUser] = {}
    for path in files:
        for user, record in _read_leaf_file(path).items():
            if user in users:
                raise DataFormatError(
                    path, f"users[{user!r}]", f"user also appears in {users[user].source}"
                )
            users[user] = record
    return dict(sorted(users.items()))


def _detect_kind(users: dict[str, LeafUser]) -> LeafKind:
    for user, rec in users.items():
        if rec.x:
            x0 = rec.x[0]
            is_list = isinstance(x0, list)
            if is_list and len(x0) > SENT140_TEXT_INDEX and isinstance(x0[4], str):
                return LeafKind.SENT140
            if is_list and x0 and all(isinstance(t, numbers.Real) for t in x0):
                return LeafKind.FEMNIST if len(x0) == FEMNIST_NUM_FEATURES else LeafKind.NUMERIC
            raise DataFormatError(
                rec.source,
                f"user_data[{user!r}].x[0]",
                "unsupported sample: expected a numeric vector or a Sent140 record",
            )
    raise DataFormatError(next(iter(users.values())).source, "user_data", "holds no samples")


def _features(user: str, rec: LeafUser, kind: LeafKind, text_features: int) -> np.ndarray:
    key = f"user_data[{user!r}].x"
    if kind is LeafKind.SENT140:
        texts = []
        for j, row in enumerate(rec.x):
            if not (isinstance(row, list) and len(row) > 4 and isinstance(row[4], str)):
                raise DataFormatError(rec.source, f"{key}[{j}]", "must be a Sent140 record")
            texts.append(row[SENT140_TEXT_INDEX])
        return hashed_bag_of_words(texts, text_features)
    try:
        arr = np.asarray(rec.x)
    except ValueError:  # ragged
        arr = np.empty(0, dtype=object)
    if arr.ndim != 2 or arr.dtype.kind not in "iuf":
        lengths = [len(r) if isinstance(r, list) else -1 for r in rec.x]
        j = next((j for j, n in enumerate(lengths) if n != lengths[0] or n < 1), 0)
        raise DataFormatError(rec.source, f"{key}[{j}]", "must be a numeric vector like x[0]")
    if not np.isfinite(arr).all():
        raise DataFormatError(rec.source, key, "holds NaN or infinity")
    return arr.astype(np.float32)


def _labels(user: str, rec: LeafUser, kind: LeafKind) -> np.ndarray:
    y = np.asarray(rec.y)
    upper = {LeafKind.FEMNIST: FEMNIST_NUM_CLASSES, LeafKind.SENT140: 2}.get(kind, 2**31)
    ok = y.ndim == 1 and y.dtype.kind in "iuf"
    ok = ok and bool(np.all(np.isfinite(y) & (y >= 0) & (y < upper) & (y == np.floor(y))))
    if not ok:
        raise DataFormatError(
            rec.source, f"user_data[{user!r}].y", f"labels must be integers in [0, {upper})"
        )
    return y.astype(np.int64)


def _convert(
    users: dict[str, LeafUser],
    kind: LeafKind,
    text_features: int,
    classes: tuple[int, ...] | None,
    dim: list[int],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for user, rec in users.items():
        if not rec.y:
            continue  # a user without samples is no client
        x, y = _features(user, rec, kind, text_features), _labels(user, rec, kind)
        if not dim:
            dim.append(x.shape[1])
        if x.shape[1] != dim[0]:
            problem = f"rows have {x.shape[1]} features, not {dim[0]}"
            raise DataFormatError(rec.source, f"user_data[{user!r}].x", problem)
        if kind is LeafKind.FEMNIST and len(y) and x.shape[1] != FEMNIST_NUM_FEATURES:
            raise DataFormatError(rec.source, f"user_data[{user!r}].x", "FEMNIST rows need 784")
        if classes is not None:
            keep = np.isin(y, classes)
            x, y = x[keep], np.searchsorted(np.array(classes), y[keep])  # classes sorted below
        out[user] = (x, y)
    return out


def load_leaf(
    directory: str | Path,
    *,
    rng: np.random.Generator | int,
    kind: LeafKind = LeafKind.AUTO,
    classes: Sequence[int] | None = None,
    text_features: int = 1024,
) -> FederatedDataset:
    """Load a LEAF data set as one client per LEAF user.

    Layouts: ``directory/train/*.json`` and ``directory/test/*.json`` (LEAF's split; clients
    are the training users, and a user without test data gets an empty test set), or
    ``directory/*.json`` whose users are each shuffled with ``rng`` and split 90/10.

    Args:
        directory: a LEAF data directory.
        rng: numpy Generator or int seed (used by the single-directory split).
        kind: sample format, see :class:`LeafKind`.
        classes: keep only these label ids, relabelled 0..len-1 in sorted order; e.g.
            :data:`FEMNIST_LOWERCASE_A_TO_J` maps 'a'..'j' (36..45) to 0..9.
        text_features: dimension of the Sent140 hashed bag of words.

    Users left without training samples (after the class filter or a 90/10 split of one
    sample) are dropped; the description counts them.
    """
    gen, seed = _rng(rng)
    if not isinstance(kind, LeafKind):
        raise InvalidParameterError("kind", kind, "a LeafKind")
    text_features = v.positive_int("text_features", text_features)
    if classes is not None:
        classes = tuple(sorted(v.nonnegative_int("classes", c) for c in classes))
        if not classes or len(set(classes)) != len(classes):
            raise InvalidParameterError("classes", classes, "distinct label ids, at least one")
    d = Path(directory)
    split_dirs = (d / "train").is_dir() and (d / "test").is_dir()
    train_raw = read_leaf_dir(d / "train" if split_dirs else d)
    test_raw = read_leaf_dir(d / "test") if split_dirs else {}
    if kind is LeafKind.AUTO:
        kind = _detect_kind(train_raw)
    dim: list[int] = []
    train = _convert(train_raw, kind, text_features, classes, dim)
    test = _convert(test_raw, kind, text_features, classes, dim)
    ids, data = [], []
    for user, (x, y) in train.items():
        if split_dirs:
            x_te, y_te = test.get(user, (np.zeros((0, x.shape[1]), np.float32), y[:0]))
            parts = (x, y, x_te, y_te)
        else:
            parts = _train_test(x, y, gen)
        if len(parts[1]):
            ids.append(user)
            data.append(parts)
    if not data:
        raise DataFormatError(d, "user_data", "no user has training samples (after filtering)")
    if classes is not None:
        num_classes = len(classes)
    elif kind is LeafKind.FEMNIST:
        num_classes = FEMNIST_NUM_CLASSES
    elif kind is LeafKind.SENT140:
        num_classes = 2
    else:
        num_classes = 1 + max(int(t[j].max(initial=0)) for t in data for j in (1, 3))
    all_raw = [*train_raw.values(), *test_raw.values()]
    description: dict[str, Any] = {
        "recipe": "leaf",
        "kind": kind.value,
        "directory": str(d),
        "layout": "train/ and test/" if split_dirs else "one directory, each user split 90/10",
        "files": sorted({str(r.source.relative_to(d)) for r in all_raw}),
        "classes": None if classes is None else list(classes),
        "label_map": None if classes is None else {str(c): i for i, c in enumerate(classes)},
        "dropped_users": len(train_raw) - len(ids),
        "test_only_users": len(set(test) - set(train)),
        "seed": seed,
    }
    if kind is LeafKind.SENT140:
        description["featuriser"] = {
            "name": "hashed_bag_of_words",
            "text_field": SENT140_TEXT_INDEX,
            "num_features": text_features,
            "tokens": _TOKEN.pattern,
            "hash": "crc32 mod num_features, rows L2-normalised",
        }
    return FederatedDataset.from_splits(
        ids,
        data,
        num_features=data[0][0].shape[1],
        num_classes=num_classes,
        description=description,
    )
