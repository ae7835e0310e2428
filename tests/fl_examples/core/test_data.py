"""Federated data: FedProx synthetic recipe, splits, LEAF JSON, MNIST IDX and the CLI grammar.

Mirrors ``fl_examples/core/data.py`` (with its ``leaf.py`` and ``idx.py``). Statistical checks
use fixed seeds, so they are deterministic; the margins were chosen so that a generator that
ignored alpha/beta or the iid switch would fail them.
"""

import gzip
import json
import math

import numpy as np
import pytest
from scipy.optimize import linprog

from fl_examples.core.data import (
    DataFormatError,
    FederatedDataset,
    Split,
    SyntheticPreset,
    breast_cancer,
    class_assignment,
    digits,
    parse_dataset_spec,
    synthetic,
)
from fl_examples.core.idx import load_mnist, read_idx, write_idx
from fl_examples.core.leaf import (
    FEMNIST_LOWERCASE_A_TO_J,
    LeafKind,
    hashed_bag_of_words,
    load_leaf,
    read_leaf_dir,
)
from privkit.errors import InvalidParameterError

# --------------------------------------------------------------------------------------------
# Synthetic


@pytest.mark.parametrize(
    "preset,d,c",
    [
        (SyntheticPreset.UPCYCLED_PAPER, 20, 10),
        (SyntheticPreset.FEDPROX, 60, 10),
        (SyntheticPreset.UPCYCLED_RELEASED_SHAPE, 20, 2),
    ],
)
@pytest.mark.parametrize("iid", [False, True])
def test_synthetic_shapes_counts_and_split(preset, d, c, iid):
    a = 0.0 if iid else 0.5
    ds = synthetic(a, a, rng=1, preset=preset, iid=iid)
    assert (ds.num_clients, ds.num_features, ds.num_classes) == (30, d, c)
    assert ds.client_ids[:2] == ("f_00000", "f_00001")
    n = ds.train_sizes + ds.test_sizes
    assert np.all(n >= 50)
    assert np.array_equal(ds.train_sizes, (0.9 * n).astype(np.int64))  # first int(0.9 n) train
    assert ds.train_sizes.min() >= 45
    for i in range(ds.num_clients):
        assert ds.x_train[i].dtype == np.float32 and ds.x_train[i].shape == (ds.train_sizes[i], d)
        assert ds.y_train[i].dtype == np.int64 and ds.x_test[i].shape == (ds.test_sizes[i], d)
        assert ds.y_train[i].min() >= 0 and ds.y_train[i].max() < c
    desc = json.loads(json.dumps(ds.description))
    assert desc["preset"] == preset.value and desc["seed"] == 1
    assert desc["recipe"] == ("fedprox_synthetic_iid" if iid else "fedprox_synthetic")
    assert desc["parameters"]["model_heterogeneity_std"] == a
    released = any("NUM_CLASS = 2" in s for s in desc["assumptions"])
    assert released == (preset is SyntheticPreset.UPCYCLED_RELEASED_SHAPE)


def test_synthetic_default_preset_and_overrides():
    ds = synthetic(0, 0, rng=0, num_clients=4, num_features=7, num_classes=3)
    assert (ds.num_clients, ds.num_features, ds.num_classes) == (4, 7, 3)
    assert ds.description["preset"] == SyntheticPreset.UPCYCLED_PAPER.value


def _arrays(ds):
    return [*ds.x_train, *ds.y_train, *ds.x_test, *ds.y_test]


def test_synthetic_seed_reproducibility():
    a, b = synthetic(0.5, 0.5, rng=7), synthetic(0.5, 0.5, rng=7)
    c = synthetic(0.5, 0.5, rng=np.random.default_rng(7))
    assert all(np.array_equal(u, w) for u, w in zip(_arrays(a), _arrays(b)))
    assert all(np.array_equal(u, w) for u, w in zip(_arrays(a), _arrays(c)))
    assert c.description["seed"] is None  # a caller's Generator has no recoverable seed
    other = synthetic(0.5, 0.5, rng=8)
    assert not np.array_equal(a.train_sizes, other.train_sizes)
    assert not np.array_equal(a.x_train[0][:45], other.x_train[0][:45])


def _mean_tv_from_global(ds):
    """Mean over clients of the total-variation distance to the pooled label distribution."""
    counts = ds.label_counts()
    pooled = counts.sum(axis=0) / counts.sum()
    return 0.5 * np.abs(ds.label_distribution() - pooled).sum(axis=1).mean()


def test_synthetic_heterogeneity_grows_with_alpha_beta():
    # 8 fixed seeds. Measured means: iid 0.09, (0,0) 0.72, (0.5,0.5) 0.75, (1,1) 0.77; classes
    # seen per client: iid 7.9, (0,0) 3.7, (1,1) 3.0 (the spec measured ~8.3 vs ~3.5).
    def stats(a, iid=False):
        sets = [synthetic(a, a, rng=s, iid=iid) for s in range(8)]
        tv = np.mean([_mean_tv_from_global(ds) for ds in sets])
        seen = np.mean([(ds.label_counts() > 0).sum(axis=1).mean() for ds in sets])
        return tv, seen

    (tv_iid, seen_iid), (tv_0, seen_0), (tv_1, seen_1) = stats(0, True), stats(0), stats(1)
    assert tv_iid + 0.3 < tv_0 < tv_1
    assert seen_iid > seen_0 + 2 > seen_1 + 2


def _linearly_separable(x, y, num_classes):
    """Is there one (W, b) with argmax(x W + b) = y on every row (margin 1, LP feasibility)?"""
    n, d = x.shape
    rows = []
    for c in range(num_classes):
        other = y != c
        # (w_c - w_y) . x + (b_c - b_y) <= -1 for rows whose label y != c
        a = np.zeros((other.sum(), num_classes, d + 1))
        xb = np.hstack([x[other], np.ones((other.sum(), 1))])
        a[:, c] += xb
        a[np.arange(other.sum()), y[other]] -= xb
        rows.append(a.reshape(other.sum(), -1))
    a_ub = np.vstack(rows)
    res = linprog(np.zeros(a_ub.shape[1]), A_ub=a_ub, b_ub=-np.ones(len(a_ub)),
                  bounds=(None, None), method="highs")  # fmt: skip
    return res.status == 0


def test_synthetic_iid_shares_one_model_and_zero_feature_means():
    kw = dict(rng=1, num_clients=10, num_classes=3)  # 1676 training rows in all
    iid = synthetic(0, 0, iid=True, **kw)
    non_iid = synthetic(0, 0, **kw)
    x, y = iid.pooled()
    assert _linearly_separable(x.astype(np.float64), y, 3)  # one shared (W, b) labels all
    x, y = non_iid.pooled()
    assert not _linearly_separable(x.astype(np.float64), y, 3)  # 10 different models
    # v_k = 0: first feature (variance 1) has client means within 5 standard errors of 0.
    means = np.array([x[:, 0].mean() for x in iid.x_train])
    assert np.all(np.abs(means) < 5 / np.sqrt(iid.train_sizes))
    means = np.array([x[:, 0].mean() for x in non_iid.x_train])
    assert np.any(np.abs(means) > 5 / np.sqrt(non_iid.train_sizes))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(model_heterogeneity_std=-0.1, data_heterogeneity_std=0, rng=0),
        dict(model_heterogeneity_std=math.nan, data_heterogeneity_std=0, rng=0),
        dict(model_heterogeneity_std=0, data_heterogeneity_std=math.inf, rng=0),
        dict(model_heterogeneity_std=0.5, data_heterogeneity_std=0.5, rng=0, iid=True),
        dict(model_heterogeneity_std=0, data_heterogeneity_std=0, rng=None),
        dict(model_heterogeneity_std=0, data_heterogeneity_std=0, rng=0, num_classes=1),
        dict(model_heterogeneity_std=0, data_heterogeneity_std=0, rng=0, num_clients=0),
        dict(model_heterogeneity_std=0, data_heterogeneity_std=0, rng=0, preset="fedprox"),
    ],
)
def test_synthetic_rejects_bad_parameters(kwargs):
    with pytest.raises(InvalidParameterError):
        synthetic(**kwargs)


# --------------------------------------------------------------------------------------------
# Container


def _tiny():
    return FederatedDataset(
        ("a", "b", "c"),
        [np.ones((3, 2)), np.zeros((1, 2)), 2 * np.ones((2, 2))],
        [[0, 1, 1], [2], [2, 2]],
        [np.ones((1, 2)), np.zeros((0, 2)), np.ones((1, 2))],
        [[1], [], [0]],
        num_features=2,
        num_classes=3,
    )


def test_container_sizes_weights_distributions_and_padding():
    ds = _tiny()
    assert ds.train_sizes.tolist() == [3, 1, 2] and ds.test_sizes.tolist() == [1, 0, 1]
    assert np.allclose(ds.weights, [0.5, 1 / 6, 1 / 3]) and math.isclose(ds.weights.sum(), 1)
    assert ds.label_counts().tolist() == [[1, 2, 0], [0, 0, 1], [0, 0, 2]]
    assert np.allclose(ds.label_distribution("test"), [[0, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert ds.y_train[1].dtype == np.int64 and ds.x_test[1].shape == (0, 2)
    p = ds.padded()
    assert p.x.shape == (3, 3, 2) and p.x.dtype == np.float32 and p.y.dtype == np.int64
    assert p.mask.sum(axis=1).tolist() == [3, 1, 2] and p.sizes.tolist() == [3, 1, 2]
    assert np.array_equal(p.x[p.mask], np.concatenate(ds.x_train))
    assert not p.x[~p.mask].any()
    q = ds.padded(Split.TEST, clients=[2, 0], pad_to=4)
    assert q.x.shape == (2, 4, 2) and q.y[:, 0].tolist() == [0, 1] and q.sizes.tolist() == [1, 1]
    x, y = ds.pooled(Split.TEST)
    assert x.shape == (2, 2) and y.tolist() == [1, 0]
    with pytest.raises(InvalidParameterError, match="pad_to"):
        ds.padded(pad_to=2)
    with pytest.raises(InvalidParameterError, match="clients"):
        ds.padded(clients=[3])
    with pytest.raises(InvalidParameterError, match="split"):
        ds.padded("validation")


@pytest.mark.parametrize(
    "y_train,x_train,match",
    [
        ([[0, 1, 3]], [np.zeros((3, 2))], "y_train"),  # label out of range
        ([[0, 1, 0.5]], [np.zeros((3, 2))], "y_train"),  # not an integer
        ([[0, 1]], [np.zeros((3, 2))], "y_train"),  # length mismatch
        ([[0, 1, 1]], [np.zeros((3, 5))], "x_train"),  # wrong feature dimension
        ([[0, 1, 1]], [np.full((3, 2), np.nan)], "x_train"),
        ([[]], [np.zeros((0, 2))], "x_train"),  # no training sample at all
    ],
)
def test_container_rejects_bad_arrays(y_train, x_train, match):
    with pytest.raises(InvalidParameterError, match=match):
        FederatedDataset(("a",), x_train, y_train, [np.zeros((0, 2))], [[]], 2, 3)


def test_container_rejects_non_json_description():
    with pytest.raises(InvalidParameterError, match="description"):
        FederatedDataset(("a",), [np.zeros((1, 2))], [[0]], [np.zeros((0, 2))], [[]], 2, 3,
                         description={"x": np.zeros(2)})  # fmt: skip


# --------------------------------------------------------------------------------------------
# scikit-learn sets and partitioning


def test_class_assignment_sliding_windows():
    a = class_assignment(30, 10, 3, rng=np.random.default_rng(0))
    assert a.shape == (30, 3) and all(len(set(row)) == 3 for row in a)
    assert np.bincount(a.ravel(), minlength=10).tolist() == [9] * 10
    with pytest.raises(InvalidParameterError, match="classes_per_client"):
        class_assignment(30, 10, 11, rng=np.random.default_rng(0))


@pytest.mark.parametrize("k", [1, 2, 5])
def test_digits_non_iid_as_configured_and_deterministic(k):
    ds = digits(rng=4, classes_per_client=k)
    seen = ds.label_counts() > 0
    assert ds.num_clients == 30 and ds.num_features == 64 and ds.num_classes == 10
    assert seen.sum(axis=1).tolist() == [k] * 30  # exactly k classes per client
    assert np.all((ds.label_counts(Split.TEST) > 0) <= seen)  # test drawn from the same classes
    assert int(ds.train_sizes.sum() + ds.test_sizes.sum()) == 1797
    n = ds.train_sizes + ds.test_sizes
    assert np.array_equal(ds.train_sizes, (0.9 * n).astype(np.int64))
    x, _ = ds.pooled()
    assert x.min() >= 0 and x.max() <= 1
    again = digits(rng=4, classes_per_client=k)
    assert all(np.array_equal(u, w) for u, w in zip(_arrays(ds), _arrays(again)))
    other = digits(rng=5, classes_per_client=k)
    assert not np.array_equal(ds.label_counts(), other.label_counts())
    assert ds.description["parameters"]["classes_per_client"] == k


def test_digits_iid_and_breast_cancer():
    ds = digits(rng=0, classes_per_client=None)
    assert (ds.label_counts() > 0).sum(axis=1).min() >= 8
    bc = breast_cancer(rng=0, num_clients=5)
    x = np.concatenate([*bc.x_train, *bc.x_test])
    assert bc.num_clients == 5 and x.shape == (569, 30) and bc.num_classes == 2
    assert np.allclose(x.mean(axis=0), 0, atol=1e-5) and np.allclose(x.std(axis=0), 1, atol=1e-4)


# --------------------------------------------------------------------------------------------
# CLI grammar


@pytest.mark.parametrize(
    "spec,clients,d,c,recipe",
    [
        ("synthetic:0.5,0.5", 30, 20, 10, "fedprox_synthetic"),
        ("synthetic:0,0:fedprox", 30, 60, 10, "fedprox_synthetic"),
        ("synthetic:1,1:released", 30, 20, 2, "fedprox_synthetic"),
        ("synthetic:iid", 30, 20, 10, "fedprox_synthetic_iid"),
        ("synthetic:iid:fedprox", 30, 60, 10, "fedprox_synthetic_iid"),
        ("digits", 30, 64, 10, "sklearn_digits"),
        ("digits:2", 30, 64, 10, "sklearn_digits"),
        ("digits:iid", 30, 64, 10, "sklearn_digits"),
        ("breast_cancer", 10, 30, 2, "sklearn_breast_cancer"),
        ("breast_cancer:4", 4, 30, 2, "sklearn_breast_cancer"),
    ],
)
def test_parse_dataset_spec_forms(spec, clients, d, c, recipe):
    ds = parse_dataset_spec(spec, seed=2)
    assert (ds.num_clients, ds.num_features, ds.num_classes) == (clients, d, c)
    assert ds.description["recipe"] == recipe and ds.description["seed"] == 2


def test_parse_dataset_spec_is_deterministic():
    a, b = (parse_dataset_spec("synthetic:0.5,0.5", seed=11) for _ in range(2))
    assert all(np.array_equal(u, w) for u, w in zip(_arrays(a), _arrays(b)))
    params = parse_dataset_spec("digits:2", seed=1).description["parameters"]
    assert params["classes_per_client"] == 2


@pytest.mark.parametrize(
    "spec",
    [
        "", "cifar10", "synthetic", "synthetic:", "synthetic:0.5", "synthetic:0.5,0.5,1",
        "synthetic:a,b", "synthetic:-1,0", "synthetic:nan,0", "synthetic:inf,0",
        "synthetic:0.5,0.5:bogus", "synthetic:0.5,0.5:paper:x", "digits:0", "digits:11",
        "digits:two", "digits:2.5", "breast_cancer:0", "leaf:", "leaf:/no/such/dir",
        "mnist:/no/such/dir", "femnist:",
    ],
)  # fmt: skip
def test_parse_dataset_spec_rejects_bad_specs(spec):
    with pytest.raises(InvalidParameterError) as info:
        parse_dataset_spec(spec, seed=0)
    assert info.value.name == "dataset"
    assert str(info.value).startswith("dataset must be one of synthetic:ALPHA,BETA")


def test_parse_dataset_spec_rejects_non_string():
    with pytest.raises(InvalidParameterError, match="dataset"):
        parse_dataset_spec(3, seed=0)


# --------------------------------------------------------------------------------------------
# LEAF JSON


def _leaf_file(path, users):
    """Write ``users = {name: (x, y)}`` as one LEAF JSON file."""
    obj = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
        "hierarchies": [],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _femnist_user(rng, n, labels):
    return rng.random((n, 784)).round(3).tolist(), [int(v) for v in rng.choice(labels, n)]


@pytest.fixture
def femnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    labels = [3, 36, 37, 40, 45, 50]
    root = tmp_path / "femnist"
    files = {
        "train/all_data_1_train.json": {"f0002_11": 9, "f0000_14": 12},
        "train/all_data_0_train.json": {"f0001_03": 7},
        "test/all_data_0_test.json": {"f0000_14": 3, "f0001_03": 2},  # f0002_11 has no test data
    }
    for name, sizes in files.items():
        _leaf_file(root / name, {u: _femnist_user(rng, n, labels) for u, n in sizes.items()})
    return root


def test_leaf_femnist_train_test_dirs(femnist_dir):
    raw = read_leaf_dir(femnist_dir / "train")
    assert list(raw) == ["f0000_14", "f0001_03", "f0002_11"]  # merged, sorted
    assert raw["f0001_03"].source.name == "all_data_0_train.json"
    ds = load_leaf(femnist_dir, rng=0)
    assert ds.description["kind"] == "femnist" and ds.description["layout"] == "train/ and test/"
    assert ds.client_ids == ("f0000_14", "f0001_03", "f0002_11")
    assert (ds.num_features, ds.num_classes) == (784, 62)
    assert ds.train_sizes.tolist() == [12, 7, 9] and ds.test_sizes.tolist() == [3, 2, 0]
    expected = np.asarray(raw["f0000_14"].x, dtype=np.float32)
    assert np.array_equal(ds.x_train[0], expected)
    assert ds.y_train[0].tolist() == raw["f0000_14"].y
    json.dumps(ds.description)


def test_leaf_femnist_lowercase_subset_is_remapped(femnist_dir):
    raw = read_leaf_dir(femnist_dir / "train")
    ds = load_leaf(femnist_dir, rng=0, kind=LeafKind.FEMNIST, classes=FEMNIST_LOWERCASE_A_TO_J)
    assert ds.num_classes == 10
    for i, user in enumerate(ds.client_ids):
        y = np.array(raw[user].y)
        keep = (y >= 36) & (y <= 45)
        assert ds.y_train[i].tolist() == (y[keep] - 36).tolist()
        assert np.array_equal(ds.x_train[i], np.asarray(raw[user].x, np.float32)[keep])
    assert ds.description["label_map"]["36"] == 0 and ds.description["label_map"]["45"] == 9
    via_spec = parse_dataset_spec(f"femnist:{femnist_dir}", seed=0)
    assert all(np.array_equal(u, w) for u, w in zip(_arrays(ds), _arrays(via_spec)))


def _sent140_user(rng, n, user):
    words = ["good", "bad", "happy", "sad", "day", "awful", "great"]
    x = [[str(1000 + j), "Mon Apr 06", "NO_QUERY", user,
          " ".join(rng.choice(words, 4)), "train"] for j in range(n)]  # fmt: skip
    return x, [int(v) for v in rng.integers(0, 2, n)]


def test_leaf_sent140_single_dir_split_and_featuriser(tmp_path):
    rng = np.random.default_rng(1)
    _leaf_file(tmp_path / "s" / "a.json", {"alice": _sent140_user(rng, 20, "alice")})
    _leaf_file(tmp_path / "s" / "b.json", {"bob": _sent140_user(rng, 11, "bob")})
    ds = load_leaf(tmp_path / "s", rng=5, text_features=64)
    assert ds.description["kind"] == "sent140" and ds.num_classes == 2 and ds.num_features == 64
    assert ds.train_sizes.tolist() == [18, 9] and ds.test_sizes.tolist() == [2, 2]  # int(0.9 n)
    x, _ = ds.pooled()
    assert np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-6)
    # the rows are a permutation of the featurised texts
    raw = read_leaf_dir(tmp_path / "s")
    texts = [r[4] for r in raw["alice"].x]
    feats = hashed_bag_of_words(texts, 64)
    both = np.concatenate([ds.x_train[0], ds.x_test[0]])
    assert sorted(map(bytes, both)) == sorted(map(bytes, feats))
    again = parse_dataset_spec(f"sent140:{tmp_path / 's'}", seed=5)
    assert again.num_features == 1024 and again.train_sizes.tolist() == [18, 9]
    assert parse_dataset_spec(f"leaf:{tmp_path / 's'}", seed=5).description["kind"] == "sent140"


def test_hashed_bag_of_words_is_deterministic_and_case_insensitive():
    a = hashed_bag_of_words(["Hello, World!", "hello world", ""], 32)
    assert np.array_equal(a[0], a[1]) and not a[2].any()
    assert np.array_equal(a, hashed_bag_of_words(["Hello, World!", "hello world", ""], 32))


_GOOD = {"users": ["u1"], "num_samples": [2], "user_data": {"u1": {"x": [[0.1, 0.2], [0.3, 0.4]], "y": [0, 1]}}}  # noqa: E501


def _mutate(obj, change):
    obj = json.loads(json.dumps(obj))
    change(obj)
    return json.dumps(obj)


@pytest.mark.parametrize(
    "text,key",
    [
        ("{not json", "<json>"),
        ("[1, 2]", "<root>"),
        (_mutate(_GOOD, lambda o: o.pop("users")), "users"),
        (_mutate(_GOOD, lambda o: o.pop("num_samples")), "num_samples"),
        (_mutate(_GOOD, lambda o: o.pop("user_data")), "user_data"),
        (_mutate(_GOOD, lambda o: o["user_data"]["u1"].pop("x")), "user_data['u1'].x"),
        (_mutate(_GOOD, lambda o: o["user_data"]["u1"].pop("y")), "user_data['u1'].y"),
        (_mutate(_GOOD, lambda o: o.update(num_samples=[3])), "user_data['u1']"),
        (_mutate(_GOOD, lambda o: o["user_data"]["u1"]["y"].append(1)), "user_data['u1']"),
        (_mutate(_GOOD, lambda o: o.update(num_samples=[2, 2])), "num_samples"),
        (_mutate(_GOOD, lambda o: o.update(users=["u2"])), "user_data"),
        (_mutate(_GOOD, lambda o: o["user_data"]["u1"]["x"][1].append(0.5)), "user_data['u1'].x[1]"),  # noqa: E501
        (_mutate(_GOOD, lambda o: o["user_data"]["u1"]["x"].__setitem__(1, "ab")), "user_data['u1'].x[1]"),  # noqa: E501
        (_mutate(_GOOD, lambda o: o["user_data"]["u1"].update(y=[0, -1])), "user_data['u1'].y"),
        (_mutate(_GOOD, lambda o: o["user_data"]["u1"].update(y=[0, "a"])), "user_data['u1'].y"),
    ],
)
def test_leaf_malformed_files_name_file_and_key(tmp_path, text, key):
    good = tmp_path / "d" / "a_good.json"
    _leaf_file(good, {"u0": ([[0.0, 1.0]] * 3, [0, 1, 0])})
    bad = tmp_path / "d" / "b_bad.json"
    bad.write_text(text)
    with pytest.raises(DataFormatError) as info:
        load_leaf(tmp_path / "d", rng=0)
    assert info.value.path == str(bad) and info.value.key == key
    assert str(info.value).startswith(f"{bad}: {key}: ")


def test_leaf_inconsistent_feature_length_across_files_and_duplicates(tmp_path):
    _leaf_file(tmp_path / "d" / "a.json", {"u0": ([[0.0, 1.0]] * 3, [0, 1, 0])})
    _leaf_file(tmp_path / "d" / "b.json", {"u1": ([[0.0, 1.0, 2.0]] * 3, [0, 1, 0])})
    with pytest.raises(DataFormatError, match=r"b\.json: user_data\['u1'\]\.x: rows have 3"):
        load_leaf(tmp_path / "d", rng=0)
    _leaf_file(tmp_path / "e" / "a.json", {"u0": ([[0.0]] * 2, [0, 1])})
    _leaf_file(tmp_path / "e" / "b.json", {"u0": ([[0.0]] * 2, [0, 1])})
    with pytest.raises(DataFormatError, match=r"b\.json: users\['u0'\]: user also appears"):
        read_leaf_dir(tmp_path / "e")
    with pytest.raises(InvalidParameterError, match="directory"):
        read_leaf_dir(tmp_path / "empty")


# --------------------------------------------------------------------------------------------
# MNIST IDX


@pytest.mark.parametrize("dtype", ["u1", "i1", "i2", "i4", "f4", "f8"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, suffix):
    arr = (np.arange(24).reshape(2, 3, 4) - (0 if dtype == "u1" else 5)).astype(dtype)
    path = tmp_path / f"a-idx3{suffix}"
    write_idx(path, arr)
    out = read_idx(path)
    assert out.dtype == np.dtype(dtype) and np.array_equal(out, arr)
    raw = gzip.decompress(path.read_bytes()) if suffix else path.read_bytes()
    codes = {"u1": 0x08, "i1": 0x09, "i2": 0x0B, "i4": 0x0C, "f4": 0x0D, "f8": 0x0E}
    assert raw[:4] == bytes([0, 0, codes[dtype], 3]) and raw[4:8] == (2).to_bytes(4, "big")


def test_idx_mnist_magic_numbers(tmp_path):
    write_idx(tmp_path / "i", np.zeros((2, 28, 28), np.uint8))
    write_idx(tmp_path / "l", np.zeros(2, np.uint8))
    assert (tmp_path / "i").read_bytes()[:4] == (2051).to_bytes(4, "big")
    assert (tmp_path / "l").read_bytes()[:4] == (2049).to_bytes(4, "big")


@pytest.mark.parametrize(
    "content,key",
    [
        (b"\x01\x00\x08\x01\x00\x00\x00\x02ab", "magic"),  # first two bytes not zero
        (b"\x00\x00\x07\x01\x00\x00\x00\x02ab", "magic"),  # unknown type byte
        (b"\x00\x00\x08\x00", "magic"),  # zero dimensions
        (b"\x00\x00", "magic"),  # too short
        (b"\x00\x00\x08\x02\x00\x00\x00\x02", "dims"),  # header cut short
        (b"\x00\x00\x08\x01\x00\x00\x00\x03ab", "data"),  # 2 bytes for 3 entries
        (b"\x00\x00\x08\x01\x00\x00\x00\x01ab", "data"),  # trailing bytes
    ],
)
def test_idx_malformed_names_file_and_field(tmp_path, content, key):
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(content)
    with pytest.raises(DataFormatError) as info:
        read_idx(path)
    assert info.value.path == str(path) and info.value.key == key
    assert str(path) in str(info.value)


def test_idx_bad_gzip_names_file(tmp_path):
    path = tmp_path / "x-idx1-ubyte.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DataFormatError, match="x-idx1-ubyte.gz: gzip"):
        read_idx(path)


def _mnist_dir(root, n_train=200, n_test=50, gz=True, test=True):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    splits = [("train", n_train)] + ([("t10k", n_test)] if test else [])
    for prefix, n in splits:
        images = rng.integers(0, 256, (n, 28, 28), np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte{ext}", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{ext}", (np.arange(n) % 10).astype(np.uint8))
    return root


def test_load_mnist_iid_and_shards(tmp_path):
    root = _mnist_dir(tmp_path / "m")
    ds = load_mnist(root, rng=0, num_clients=5)
    assert (ds.num_clients, ds.num_features, ds.num_classes) == (5, 784, 10)
    assert ds.train_sizes.tolist() == [40] * 5 and ds.test_sizes.tolist() == [10] * 5
    x, y = ds.pooled()
    images = read_idx(root / "train-images-idx3-ubyte.gz").reshape(200, -1) / 255.0
    assert x.max() <= 1 and sorted(map(bytes, x)) == sorted(map(bytes, images.astype(np.float32)))
    assert np.bincount(y).tolist() == [20] * 10
    shards = load_mnist(root, rng=0, num_clients=10, classes_per_client=2)
    train_seen, test_seen = shards.label_counts() > 0, shards.label_counts("test") > 0
    assert train_seen.sum(axis=1).tolist() == [2] * 10 and np.all(test_seen <= train_seen)
    assert parse_dataset_spec(f"mnist:{root}", seed=0).num_clients == 30


def test_load_mnist_without_t10k_splits_each_client(tmp_path):
    ds = load_mnist(_mnist_dir(tmp_path / "m", gz=False, test=False), rng=0, num_clients=4)
    assert ds.train_sizes.tolist() == [45] * 4 and ds.test_sizes.tolist() == [5] * 4


def test_load_mnist_rejects_wrong_files(tmp_path):
    root = _mnist_dir(tmp_path / "m", gz=False)
    labels = root / "t10k-labels-idx1-ubyte"
    write_idx(labels, np.zeros(49, np.uint8))
    with pytest.raises(DataFormatError, match="t10k-labels-idx1-ubyte: dims: 49 labels for 50"):
        load_mnist(root, rng=0)
    write_idx(labels, np.zeros(50, np.int32))
    with pytest.raises(DataFormatError, match="t10k-labels-idx1-ubyte: magic: expected 2049"):
        load_mnist(root, rng=0)
    write_idx(labels, np.full(50, 10, np.uint8))
    with pytest.raises(DataFormatError, match="t10k-labels-idx1-ubyte: data: label 10"):
        load_mnist(root, rng=0)
    labels.unlink()
    with pytest.raises(InvalidParameterError, match="both t10k files or neither"):
        load_mnist(root, rng=0)
    with pytest.raises(InvalidParameterError, match="train-images-idx3-ubyte"):
        load_mnist(tmp_path, rng=0)


# --------------------------------------------------------------------------------------------
# Sent140 token ids (sent140tok)


def _tweets(user, texts, labels):
    x = [[str(2000 + j), "Mon Apr 06", "NO_QUERY", user, t, "x"] for j, t in enumerate(texts)]
    return x, labels


@pytest.fixture
def sent140tok_dir(tmp_path):
    root = tmp_path / "sent140"
    _leaf_file(root / "train" / "t.json", {
        "u1": _tweets("u1", ["Good good day", "bad DAY", "good"], [1, 0, 1]),
        "u2": _tweets("u2", ["happy happy happy day", "sad"], [1, 0]),
        "u3": _tweets("u3", ["awful, bad day " * 10, "zebra good", "day"], [0, 1, 0]),
    })  # fmt: skip
    _leaf_file(root / "test" / "t.json", {
        "u1": _tweets("u1", ["good unseenword", "testonly testonly testonly"], [1, 0]),
        "u3": _tweets("u3", ["bad"], [0]),
    })  # fmt: skip
    return root


def test_sent140_tokens_vocabulary_from_train_only(sent140tok_dir):
    from fl_examples.core.leaf import build_vocabulary, token_ids, tokenize

    ds = load_leaf(sent140tok_dir, rng=0, kind=LeafKind.SENT140_TOKENS, vocab_size=7, seq_len=5)
    # training counts: day 14, bad 11, awful 10, good 5, happy 3, sad 1, zebra 1
    vocab = {"day": 2, "bad": 3, "awful": 4, "good": 5, "happy": 6}
    assert build_vocabulary([tokenize(t) for t in ["b a", "a b c"]], 3) == {"a": 2}  # tie: word
    assert ds.description["vocab_size"] == 7 and ds.description["seq_len"] == 5
    assert ds.description["tokenizer"]["max_vocab_size"] == 7
    assert ds.description["kind"] == "sent140tok"
    assert (ds.num_features, ds.num_classes) == (5, 2)
    assert ds.client_ids == ("u1", "u2", "u3")
    assert ds.train_sizes.tolist() == [3, 2, 3] and ds.test_sizes.tolist() == [2, 0, 1]
    assert ds.x_train[0].dtype == np.float32
    assert ds.x_train[0].tolist() == [[5, 5, 2, 0, 0], [3, 2, 0, 0, 0], [5, 0, 0, 0, 0]]
    assert ds.x_train[1].tolist() == [[6, 6, 6, 2, 0], [1, 0, 0, 0, 0]]  # sad: not in top 5
    assert ds.x_train[2].tolist() == [[4, 3, 2, 4, 3], [1, 5, 0, 0, 0], [2, 0, 0, 0, 0]]
    assert ds.x_test[0].tolist() == [[5, 1, 0, 0, 0], [1, 1, 1, 0, 0]]  # test words are unknown
    assert ds.x_test[2].tolist() == [[3, 0, 0, 0, 0]]
    assert ds.y_train[2].tolist() == [0, 1, 0]
    texts = ["Good good day", "bad DAY", "good"]
    assert np.array_equal(token_ids([tokenize(t) for t in texts], vocab, 5), ds.x_train[0])
    json.dumps(ds.description)


def test_sent140_tokens_defaults_spec_and_single_dir(sent140tok_dir, tmp_path):
    ds = parse_dataset_spec(f"sent140tok:{sent140tok_dir}", seed=0)
    assert ds.num_features == 25 and ds.description["seq_len"] == 25
    assert ds.description["vocab_size"] == 2 + 7  # all seven training words fit
    x, _ = ds.pooled()
    assert x.shape[1] == 25 and x.max() < 9 and np.all(x == np.floor(x))
    long_row = ds.x_train[2][0]  # "awful bad day" x 10 = 30 tokens, truncated to the first 25
    vocab = {"day": 2, "bad": 3, "awful": 4}  # counts 14, 11, 10
    assert long_row.tolist() == [vocab[w] for w in ("awful bad day " * 10).split()[:25]]
    assert np.all(np.delete(x, 5, axis=0)[:, 4:] == 0)  # other texts have <= 4 tokens
    again = parse_dataset_spec(f"sent140tok:{sent140tok_dir}", seed=0)
    assert all(np.array_equal(u, w) for u, w in zip(_arrays(ds), _arrays(again)))
    # single directory: the vocabulary comes from each user's 90% training share only
    rng = np.random.default_rng(1)
    _leaf_file(tmp_path / "one" / "a.json", {"alice": _sent140_user(rng, 20, "alice")})
    one = load_leaf(tmp_path / "one", rng=5, kind=LeafKind.SENT140_TOKENS, seq_len=3)
    assert one.train_sizes.tolist() == [18] and one.test_sizes.tolist() == [2]
    assert one.num_features == 3 and one.description["layout"].startswith("one directory")
    assert load_leaf(tmp_path / "one", rng=0).description["kind"] == "sent140"  # AUTO unchanged
    with pytest.raises(InvalidParameterError, match="vocab_size"):
        load_leaf(sent140tok_dir, rng=0, kind=LeafKind.SENT140_TOKENS, vocab_size=1)
    with pytest.raises(InvalidParameterError, match="dataset"):
        parse_dataset_spec(f"sent140tok:{tmp_path / 'missing'}", seed=0)
