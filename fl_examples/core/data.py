"""Federated data sets: FedProx synthetic data, the offline sets and the CLI grammar.

Every generator takes an explicit :class:`numpy.random.Generator` (or an ``int`` seed that is
turned into one with :func:`numpy.random.default_rng`) and returns a :class:`FederatedDataset`
(:mod:`fl_examples.core.dataset`, re-exported here) whose ``description`` says, as JSON, how it
was made. Nothing downloads: real LEAF and MNIST files come from a directory the user supplies
(:mod:`fl_examples.core.leaf`, :mod:`fl_examples.core.idx`) and the small offline sets come
with scikit-learn.

Spec: ``shared/spec/data.md``.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

# The container and its helpers live in dataset.py; the names below stay importable from here.
from fl_examples.core.dataset import TRAIN_FRACTION as TRAIN_FRACTION
from fl_examples.core.dataset import DataFormatError as DataFormatError
from fl_examples.core.dataset import FederatedDataset as FederatedDataset
from fl_examples.core.dataset import PaddedClients as PaddedClients
from fl_examples.core.dataset import Split as Split
from fl_examples.core.dataset import _rng, _train_test
from fl_examples.core.dataset import class_assignment as class_assignment
from fl_examples.core.dataset import from_partition as from_partition
from fl_examples.core.dataset import partition_by_classes as partition_by_classes
from fl_examples.core.dataset import partition_iid as partition_iid
from privkit import _validate as v
from privkit.errors import InvalidParameterError

__all__ = ["SyntheticPreset", "synthetic", "heldout_clients", "digits", "breast_cancer",
           "parse_dataset_spec", "check_dataset_spec", "check_digits_clients",
           "DATASET_SPEC_FORMS", "DIGITS_RECORDS", "MAX_SYNTHETIC_CLIENTS"]

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
    max_client_size: int | None = None,
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
        max_client_size: optional cap on n_k (the recipe's lognormal sizes have a heavy tail:
            with thousands of clients some hold tens of thousands of records); None = the
            recipe's sizes.
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
    if max_client_size is not None:
        sizes = np.minimum(sizes, v.positive_int("max_client_size", max_client_size))
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
    # The public held-out set: all records of further clients drawn by the same recipe,
    # after the population (whose draws are unchanged), so no client of it holds them.
    h = heldout_clients(k_clients)
    h_sizes = gen.lognormal(4.0, 2.0, h).astype(np.int64) + 50
    if max_client_size is not None:
        h_sizes = np.minimum(h_sizes, max_client_size)
    hx, hy = [], []
    for i in range(h):
        if iid:
            v_i, w, b = np.zeros(d), w_global, b_global
        else:
            u_i, b_i = gen.normal(0.0, alpha), gen.normal(0.0, beta)
            v_i = gen.normal(b_i, 1.0, d)
            w, b = gen.normal(u_i, 1.0, (d, c)), gen.normal(u_i, 1.0, c)
        x = v_i + std_x * gen.standard_normal((int(h_sizes[i]), d))
        hx.append(x)
        hy.append(np.argmax(x @ w + b, axis=1))

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
        "heldout": f"all {int(h_sizes.sum())} records of {h} further clients drawn by the same "
                   "recipe after the population (no client of it holds them); public",
    }  # fmt: skip
    ids = [f"f_{i:05d}" for i in range(k_clients)]
    return FederatedDataset.from_splits(
        ids, data, num_features=d, num_classes=c, description=description,
        heldout=(np.concatenate(hx), np.concatenate(hy)),
    )


def heldout_clients(num_clients: int) -> int:
    """How many further clients make the synthetic data's held-out set: a tenth of the
    population, at least 10 and at most 100.

    >>> heldout_clients(30), heldout_clients(2000)
    (10, 100)
    """
    return min(100, max(10, math.ceil(num_clients / 10)))


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
    parts = _digits_parts(y, k_clients, classes_per_client, gen)
    partition = "iid" if classes_per_client is None else "classes_per_client"
    description = {
        "recipe": "sklearn_digits", "seed": seed,
        "parameters": {"num_clients": k_clients, "classes_per_client": classes_per_client,
                       "partition": partition, "train_fraction": TRAIN_FRACTION},
        "preprocessing": "pixel / 16, in [0, 1]", "feature_l2_bound": 8.0,
        "assumptions": ["sklearn.datasets.load_digits stands in for FEMNIST (no writer ids)"],
    }  # fmt: skip
    return from_partition(x, y, parts, rng=gen, num_classes=10, description=description)


def _digits_parts(y: np.ndarray, k_clients: int, classes_per_client: int | None,
                  gen: np.random.Generator) -> list:
    """The clients' index arrays into the digits (IID, or ``classes_per_client`` classes
    each); the draws :func:`digits` makes first, so :func:`check_digits_clients` can size the
    clients from the labels alone."""
    if classes_per_client is None:
        return partition_iid(len(y), k_clients, rng=gen)
    assignment = class_assignment(k_clients, 10, classes_per_client, rng=gen)
    return partition_by_classes(y, assignment, rng=gen)


DIGITS_RECORDS = 1797
"""Records in scikit-learn's digits: no split has more clients."""


@functools.lru_cache(maxsize=1)
def _digits_labels() -> np.ndarray:
    from sklearn.datasets import load_digits

    y = load_digits().target
    y.setflags(write=False)
    return y


def check_digits_clients(name: str, value: object, *, num_clients: int,
                         classes_per_client: int | None, seed: int) -> None:
    """Refuse a digits split in which a client would hold no training record, before the data
    is built (exact: the same partition :func:`digits` makes with this ``seed``).

    A client of n records trains on ``int(0.9 n)`` of them, so every client needs two; there
    are :data:`DIGITS_RECORDS` records in all.

    Raises:
        InvalidParameterError: naming ``name`` (the flag that set the clients) with ``value``.

    Example:
        >>> check_digits_clients("dataset", "digits:iid@898", num_clients=898,
        ...                      classes_per_client=None, seed=0)
    """
    k = v.positive_int("num_clients", num_clients)
    most = DIGITS_RECORDS // 2
    if k > most:
        raise InvalidParameterError(
            name, value, f"a split of the {DIGITS_RECORDS} digits records into at most {most} "
            f"clients (each client needs two records, one to train on; {k} clients asked)")
    if classes_per_client is None:
        return  # near-equal parts: every client holds at least two records
    gen, _ = _rng(v.nonnegative_int("seed", seed))
    sizes = [len(p) for p in _digits_parts(_digits_labels(), k, classes_per_client, gen)]
    poorest = int(np.argmin(sizes))
    if int(TRAIN_FRACTION * sizes[poorest]) < 1:
        raise InvalidParameterError(
            name, value, f"a split in which every client holds a training record (with "
            f"{classes_per_client} classes per client and seed {seed}, client {poorest} of {k} "
            f"would hold {sizes[poorest]} of the {DIGITS_RECORDS} records, none to train on); "
            "use fewer clients or more classes per client")


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
        "data_dependent_preprocessing": "features standardised with the mean and std of all "
                                        "rows, the clients' included",
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


MAX_SYNTHETIC_CLIENTS = 1_000_000
"""The most clients ``synthetic...@CLIENTS`` makes (about 450 records each unless /MAXSIZE)."""


def parse_dataset_spec(spec: str, *, seed: int) -> FederatedDataset:
    """Build a data set from a CLI string; the seed makes it deterministic.

    Grammar (``DIR`` is everything after the first colon, so it may contain colons):

    - ``synthetic:ALPHA,BETA[:PRESET]``: :func:`synthetic` with those standard deviations,
      e.g. ``synthetic:0.5,0.5``. ``PRESET`` is ``paper`` (default; 20-d, 10 classes),
      ``fedprox`` (60-d, 10 classes) or ``released`` (20-d, 2 classes).
    - a suffix ``@CLIENTS[/MAXSIZE]`` on ``synthetic`` and ``digits`` sets the number of
      clients (default 30) and, for ``synthetic``, caps each client's records: e.g.
      ``synthetic:0.5,0.5@2000/500`` (2000 clients of at most 500 records). A client needs
      two records (it trains on 90% of them): MAXSIZE >= 2, at most
      :data:`MAX_SYNTHETIC_CLIENTS` synthetic clients, and a digits split in which every
      client holds two (:func:`check_digits_clients`; at most 898 clients IID).
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
        InvalidParameterError: naming ``dataset`` for an unknown form, a bad number or a
            split with a client that holds no training record.
        DataFormatError: a LEAF or IDX file is malformed (names the file and key).

    Example:
        >>> parse_dataset_spec("synthetic:1,1:fedprox", seed=3).num_features
        60
    """
    return _parse(spec, seed)()


def check_dataset_spec(spec: str, *, seed: int = 0) -> None:
    """Check ``spec`` as :func:`parse_dataset_spec` does, without reading or making any data:
    the grammar, the numbers, the client counts (and that a DIR exists). A command calls it
    before it touches its output directory.

    Example:
        >>> try:
        ...     check_dataset_spec("digits:3@100000")
        ... except InvalidParameterError as exc:
        ...     print(exc.name, "|", exc.requirement[:45])
        dataset | a split of the 1797 digits records into at mo
    """
    _parse(spec, seed)


def _parse(spec: str, seed: int) -> Callable[[], FederatedDataset]:
    """The grammar of :func:`parse_dataset_spec`: every check, then the loader to call."""
    if not isinstance(spec, str):
        raise _bad(repr(spec), "not a string")
    seed = v.nonnegative_int("seed", seed)
    body, at, count = spec.strip().partition("@")
    name, _, rest = body.partition(":")
    name = name.lower()
    clients, cap = 30, None
    if at:
        if name not in ("synthetic", "digits"):
            raise _bad(spec, "@CLIENTS applies to synthetic and digits only")
        n_text, slash, cap_text = count.partition("/")
        clients = int(_number(spec, n_text, integer=True))
        if clients < 1:
            raise _bad(spec, "@CLIENTS needs at least 1 client")
        if slash:
            if name != "synthetic":
                raise _bad(spec, "/MAXSIZE applies to synthetic only")
            cap = int(_number(spec, cap_text, integer=True))
            if cap < 2:
                raise _bad(spec, "/MAXSIZE needs at least 2 records: a client trains on 90% "
                           "of its records")
    if name == "synthetic":
        args = rest.split(":")
        if not rest or len(args) > 2:
            raise _bad(spec, "synthetic needs ALPHA,BETA or iid")
        preset = _PRESETS.get(args[1].lower()) if len(args) == 2 else _PRESETS["paper"]
        if preset is None:
            raise _bad(spec, f"unknown preset {args[1]!r}")
        if clients > MAX_SYNTHETIC_CLIENTS:
            raise InvalidParameterError(
                "dataset", spec, f"at most {MAX_SYNTHETIC_CLIENTS} synthetic clients (about "
                f"450 records each unless /MAXSIZE caps them; {clients} asked)")
        if args[0].lower() == "iid":
            return functools.partial(synthetic, 0.0, 0.0, rng=seed, preset=preset, iid=True,
                                     num_clients=clients, max_client_size=cap)
        pair = args[0].split(",")
        if len(pair) != 2:
            raise _bad(spec, "synthetic needs two numbers ALPHA,BETA")
        alpha, beta = (_number(spec, t) for t in pair)
        return functools.partial(synthetic, alpha, beta, rng=seed, preset=preset,
                                 num_clients=clients, max_client_size=cap)
    if name == "digits":
        if rest.lower() == "iid":
            k: int | None = None
        else:
            k = int(_number(spec, rest, integer=True)) if rest else 5
            if not 1 <= k <= 10:
                raise _bad(spec, "digits:K needs 1 <= K <= 10")
        check_digits_clients("dataset", spec, num_clients=clients, classes_per_client=k,
                             seed=seed)
        return functools.partial(digits, rng=seed, classes_per_client=k, num_clients=clients)
    if name == "breast_cancer":
        k = int(_number(spec, rest, integer=True)) if rest else 10
        if not 1 <= k <= 56:
            raise _bad(spec, "breast_cancer:CLIENTS needs 1 <= CLIENTS <= 56")
        return functools.partial(breast_cancer, rng=seed, num_clients=k)
    if name in ("leaf", "femnist", "sent140", "sent140tok", "mnist"):
        if not rest or not Path(rest).is_dir():
            raise _bad(spec, f"{name}:DIR needs an existing directory")
        return functools.partial(_load_dir, name, rest, seed)
    raise _bad(spec, f"unknown dataset {name!r}")


def _load_dir(name: str, directory: str, seed: int) -> FederatedDataset:
    """``mnist:DIR`` and the LEAF forms of :func:`parse_dataset_spec`."""
    if name == "mnist":
        from fl_examples.core.idx import load_mnist

        return load_mnist(directory, rng=seed)
    from fl_examples.core.leaf import FEMNIST_LOWERCASE_A_TO_J, LeafKind, load_leaf

    if name == "femnist":
        return load_leaf(directory, rng=seed, kind=LeafKind.FEMNIST,
                         classes=FEMNIST_LOWERCASE_A_TO_J)
    if name == "sent140tok":
        return load_leaf(directory, rng=seed, kind=LeafKind.SENT140_TOKENS)
    kind = LeafKind.SENT140 if name == "sent140" else LeafKind.AUTO
    return load_leaf(directory, rng=seed, kind=kind)
