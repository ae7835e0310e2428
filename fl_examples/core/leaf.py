"""LEAF JSON data (FEMNIST, Sent140, LEAF synthetic) from a user-supplied directory.

Sent140 text becomes either a hashed bag of words (:attr:`LeafKind.SENT140`, for linear
models) or padded token ids over a vocabulary of the training split
(:attr:`LeafKind.SENT140_TOKENS`, for :class:`~fl_examples.core.deep_models.StackedLSTM`).

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

from fl_examples.core.dataset import (
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
    "build_vocabulary",
    "hashed_bag_of_words",
    "token_ids",
    "tokenize",
    "read_leaf_dir",
    "load_leaf",
]

FEMNIST_LOWERCASE_A_TO_J = tuple(range(36, 46))
"""LEAF FEMNIST ids of 'a'..'j' (digits 0-9, upper case 10-35, lower case 36-61); Upcycled-FL
keeps these ten classes, relabelled 0..9 by ``load_leaf(..., classes=...)``."""

FEMNIST_NUM_FEATURES = 784
FEMNIST_NUM_CLASSES = 62
SENT140_TEXT_INDEX = 4  # x = [tweet_id, date, query, user, text, split]
PAD_ID = 0
UNKNOWN_ID = 1
_MAX_EXACT_FLOAT32_INT = 2**24  # token ids are stored as float32 features


class LeafKind(enum.Enum):
    """How to turn a LEAF sample into a feature vector.

    - ``AUTO``: inspect the first sample: a Sent140 record (a list whose item 4 is a string)
      is ``SENT140``; a numeric vector of length 784 is ``FEMNIST``; another numeric vector is
      ``NUMERIC``.
    - ``FEMNIST``: 784 floats in [0, 1] (28 x 28, flattened), labels 0..61.
    - ``SENT140``: ``[tweet_id, date, query, user, text, split]`` with labels 0/1; the text is
      featurised by :func:`hashed_bag_of_words`.
    - ``SENT140_TOKENS``: the same records; the text becomes ``seq_len`` token ids (as floats)
      over a vocabulary built from the training split (:func:`build_vocabulary`,
      :func:`token_ids`). Never chosen by ``AUTO``.
    - ``NUMERIC``: fixed-length numeric vectors (e.g. LEAF's synthetic set); the number of
      classes is the largest label + 1.
    """

    AUTO = "auto"
    FEMNIST = "femnist"
    SENT140 = "sent140"
    SENT140_TOKENS = "sent140tok"
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


def tokenize(text: str) -> list[str]:
    """Lower-case word tokens ``[a-z0-9']+`` of ``text`` (as in :func:`hashed_bag_of_words`).

    Example:
        >>> tokenize("Good DAY, isn't it?")
        ['good', 'day', "isn't", 'it']
    """
    return _TOKEN.findall(text.lower())


def build_vocabulary(token_lists: Sequence[Sequence[str]], vocab_size: int) -> dict[str, int]:
    """Word -> id for the ``vocab_size - 2`` most frequent words of ``token_lists``.

    Id 0 is padding and id 1 the unknown word, so words get ids 2, 3, ... in order of
    decreasing count; equal counts are ordered by the word itself (deterministic). Fewer
    distinct words give a smaller vocabulary (``len(vocab) + 2 <= vocab_size``).

    Example:
        >>> build_vocabulary([["b", "a", "c"], ["a", "c"]], vocab_size=4)
        {'a': 2, 'c': 3}
    """
    size = v.positive_int("vocab_size", vocab_size)
    if size < 2:
        raise InvalidParameterError("vocab_size", vocab_size, "an integer >= 2 (pad, unknown)")
    counts: dict[str, int] = {}
    for tokens in token_lists:
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))[: size - 2]
    return {w: i + 2 for i, w in enumerate(ranked)}


def token_ids(
    token_lists: Sequence[Sequence[str]], vocab: dict[str, int], seq_len: int = 25
) -> np.ndarray:
    """float32 ``(n, seq_len)``: each text's first ``seq_len`` ids, right-padded with 0.

    A word outside ``vocab`` gets id 1 (unknown).

    Example:
        >>> token_ids([["a", "zzz"], ["c", "a", "c"]], {"a": 2, "c": 3}, seq_len=2).tolist()
        [[2.0, 1.0], [3.0, 2.0]]
    """
    length = v.positive_int("seq_len", seq_len)
    out = np.full((len(token_lists), length), PAD_ID, dtype=np.float32)
    for row, tokens in enumerate(token_lists):
        ids = [vocab.get(t, UNKNOWN_ID) for t in tokens[:length]]
        out[row, : len(ids)] = ids
    return out


def _read_leaf_file(path: Path) -> dict[str, LeafUser]:
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataFormatError(path, "<json>", f"not valid JSON ({exc})") from None
    except RecursionError:
        raise DataFormatError(path, "<json>", "nested too deeply to read (not LEAF data)") \
            from None
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


def _detect_kind(users: dict[str, LeafUser], directory: Path) -> LeafKind:
    if not users:
        raise DataFormatError(directory, "users", "lists no user (every file's users is empty)")
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


def _features(
    user: str, rec: LeafUser, kind: LeafKind, text_features: int, tokens: list[list[str]]
) -> np.ndarray:
    key = f"user_data[{user!r}].x"
    if kind in (LeafKind.SENT140, LeafKind.SENT140_TOKENS):
        texts = []
        for j, row in enumerate(rec.x):
            if not (isinstance(row, list) and len(row) > 4 and isinstance(row[4], str)):
                raise DataFormatError(rec.source, f"{key}[{j}]", "must be a Sent140 record")
            texts.append(row[SENT140_TEXT_INDEX])
        if kind is LeafKind.SENT140:
            return hashed_bag_of_words(texts, text_features)
        # One column: the row of each text in ``tokens``; ids come after the train/test split.
        start = len(tokens)
        tokens.extend(tokenize(t) for t in texts)
        return np.arange(start, len(tokens), dtype=np.int64)[:, None]
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
    upper = {LeafKind.FEMNIST: FEMNIST_NUM_CLASSES, LeafKind.SENT140: 2,
             LeafKind.SENT140_TOKENS: 2}.get(kind, 2**31)  # fmt: skip
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
    tokens: list[list[str]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for user, rec in users.items():
        if not rec.y:
            continue  # a user without samples is no client
        x = _features(user, rec, kind, text_features, tokens)
        y = _labels(user, rec, kind)
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
    vocab_size: int = 10_000,
    seq_len: int = 25,
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
        vocab_size: ``SENT140_TOKENS``: at most this many ids (0 padding, 1 unknown, then the
            ``vocab_size - 2`` most frequent words of the training split, ties by word).
        seq_len: ``SENT140_TOKENS``: ids per text (the first ``seq_len`` tokens, right-padded
            with 0); it is ``num_features``.

    With ``SENT140_TOKENS`` the vocabulary comes from the training split only (the kept
    clients' training rows, after the 90/10 split of a single directory), so test words
    unseen in training map to 1. The description records ``vocab_size`` (ids in use, the
    embedding size a model needs), ``seq_len`` and ``tokenizer``.

    Users left without training samples (after the class filter or a 90/10 split of one
    sample) are dropped; the description counts them.
    """
    gen, seed = _rng(rng)
    if not isinstance(kind, LeafKind):
        raise InvalidParameterError("kind", kind, "a LeafKind")
    text_features = v.positive_int("text_features", text_features)
    vocab_size = v.positive_int("vocab_size", vocab_size)
    if not 2 <= vocab_size <= _MAX_EXACT_FLOAT32_INT:
        raise InvalidParameterError("vocab_size", vocab_size, "in [2, 2**24] (ids as float32)")
    seq_len = v.positive_int("seq_len", seq_len)
    if classes is not None:
        classes = tuple(sorted(v.nonnegative_int("classes", c) for c in classes))
        if not classes or len(set(classes)) != len(classes):
            raise InvalidParameterError("classes", classes, "distinct label ids, at least one")
    d = Path(directory)
    split_dirs = (d / "train").is_dir() and (d / "test").is_dir()
    train_raw = read_leaf_dir(d / "train" if split_dirs else d)
    test_raw = read_leaf_dir(d / "test") if split_dirs else {}
    if kind is LeafKind.AUTO:
        kind = _detect_kind(train_raw, d / "train" if split_dirs else d)
    dim: list[int] = []
    tokens: list[list[str]] = []
    train = _convert(train_raw, kind, text_features, classes, dim, tokens)
    test = _convert(test_raw, kind, text_features, classes, dim, tokens)
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
    vocab: dict[str, int] = {}
    train_words: set[str] = set()
    if kind is LeafKind.SENT140_TOKENS:
        train_tokens = [tokens[int(i)] for parts in data for i in parts[0][:, 0]]
        train_words = {t for row in train_tokens for t in row}
        vocab = build_vocabulary(train_tokens, vocab_size)
        data = [
            tuple(  # type: ignore[misc]  # (x, y, x, y) stays a 4-tuple
                token_ids([tokens[int(i)] for i in a[:, 0]], vocab, seq_len) if j % 2 == 0 else a
                for j, a in enumerate(parts)
            )
            for parts in data
        ]
    if classes is not None:
        num_classes = len(classes)
    elif kind is LeafKind.FEMNIST:
        num_classes = FEMNIST_NUM_CLASSES
    elif kind in (LeafKind.SENT140, LeafKind.SENT140_TOKENS):
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
    if kind is LeafKind.SENT140_TOKENS:
        description["vocab_size"] = len(vocab) + 2
        description["data_dependent_preprocessing"] = (
            "the vocabulary (and vocab_size, distinct_training_words) comes from the clients' "
            "training tweets")
        description["seq_len"] = seq_len
        description["tokenizer"] = {
            "name": "sent140_word_ids",
            "text_field": SENT140_TEXT_INDEX,
            "tokens": _TOKEN.pattern,
            "lowercase": True,
            "vocabulary": "most frequent max_vocab_size - 2 words of the training split, "
            "ties broken by word; id 0 padding, id 1 unknown",
            "max_vocab_size": vocab_size,
            "distinct_training_words": len(train_words),
            "sequence": "first seq_len ids, right-padded with 0, stored as float32",
        }
    return FederatedDataset.from_splits(
        ids,
        data,
        num_features=data[0][0].shape[1],
        num_classes=num_classes,
        description=description,
    )
