"""SCFL coded data: shapes, reproducibility, order independence, noise level, clipping, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privkit.accountants.midp import LabelMode, midp_coded_release
from privkit.errors import InvalidParameterError
from privkit.mechanisms.coded import client_rng, code_client_data, sum_uploads
from privkit.mechanisms.sampling import SecureRandom

RNG = np.random.default_rng(5)
X = RNG.uniform(-1, 1, (7, 3))
Y = np.eye(4)[RNG.integers(0, 4, 7)]


def _code(x=X, y=Y, rng=None, **kw):
    args = dict(num_coded_rows=6, stddev=0.5, row_l2_bound=1.0)
    args |= kw
    return code_client_data(x, y, rng=rng if rng is not None else client_rng(1, "a"), **args)


def test_shapes_and_event():
    up = _code()
    assert up.coded_features.shape == (6, 3) and up.coded_labels.shape == (6, 4)
    ev = up.event
    assert (ev.num_coded_rows, ev.stddev, ev.row_l2_bound, ev.dim) == (6, 0.5, 1.0, 3)
    assert ev.label_mode is LabelMode.NOISY and ev.label_stddev == 0.5  # default sigma_y = sigma
    assert ev.label_dim == 4 and ev.categorical_labels and ev.label_l2_bound == 1.0
    assert math.isfinite(midp_coded_release(ev).nats)


def test_same_seed_same_coded_data_and_different_seed_differs():
    a, b = _code(rng=client_rng(3, "x")), _code(rng=client_rng(3, "x"))
    assert np.array_equal(a.coded_features, b.coded_features)
    assert np.array_equal(a.coded_labels, b.coded_labels)
    c = _code(rng=client_rng(4, "x"))
    d = _code(rng=client_rng(3, "y"))
    assert not np.allclose(a.coded_features, c.coded_features)
    assert not np.allclose(a.coded_features, d.coded_features)


def test_coded_rows_independent_of_client_order():
    data = {f"client-{i}": (RNG.uniform(-1, 1, (5 + i, 3)), np.eye(4)[RNG.integers(0, 4, 5 + i)])
            for i in range(5)}

    def server(order):
        ups = {}
        for cid in order:  # each client codes with its own generator, in any order
            x, y = data[cid]
            ups[cid] = _code(x, y, rng=client_rng(9, cid))
        return sum_uploads(ups)

    ids = list(data)
    x1, y1 = server(ids)
    x2, y2 = server(ids[::-1])
    x3, y3 = server([ids[2], ids[0], ids[4], ids[1], ids[3]])
    assert np.array_equal(x1, x2) and np.array_equal(x1, x3)
    assert np.array_equal(y1, y2) and np.array_equal(y1, y3)


def test_noise_stddev_applied_is_the_one_requested():
    # X = 0: the coded features are exactly sigma N; the labels' part G Y vanishes for Y = 0.
    for sigma, sy in ((0.3, 0.3), (2.0, 0.7)):
        up = code_client_data(np.zeros((3, 50)), np.zeros((3, 40)), num_coded_rows=400,
                              stddev=sigma, row_l2_bound=1.0, label_stddev=sy,
                              label_l2_bound=1.0, categorical_labels=False,
                              rng=np.random.default_rng(0))
        # n = 20000 draws: the sample std's relative standard error is 1/sqrt(2n) = 0.5%;
        # 3% is 6 standard errors (false-failure rate < 1e-8).
        assert up.coded_features.std() == pytest.approx(sigma, rel=0.03)
        assert up.coded_labels.std() == pytest.approx(sy, rel=0.03)
        assert abs(up.coded_features.mean()) < 6 * sigma / math.sqrt(20000)


def test_coding_matrix_is_standard_normal_and_projection_unbiased():
    # E[X~^T X~] / c = X^T X + sigma^2 d-identity: check with many rows.
    x = np.array([[1.0, 0.0], [0.6, 0.8]])
    up = code_client_data(x, None, num_coded_rows=200000, stddev=0.5, row_l2_bound=1.0,
                          rng=np.random.default_rng(1))
    emp = up.coded_features.T @ up.coded_features / 200000
    # each entry's standard error is at most about sqrt(2) * 1.25 / sqrt(2e5) = 0.004
    assert np.allclose(emp, x.T @ x + 0.25 * np.eye(2), atol=0.025)
    assert up.coded_labels is None and up.event.label_mode is LabelMode.NONE


def test_rows_and_labels_are_clipped():
    big = np.array([[30.0, 40.0]])  # norm 50, clipped to 2
    up = code_client_data(big, None, num_coded_rows=50000, stddev=1e-9, row_l2_bound=2.0,
                          rng=np.random.default_rng(2))
    # coded rows are g * x_clipped: E||row||^2 = ||x_clipped||^2 = 4
    assert np.mean(np.sum(up.coded_features**2, axis=1)) == pytest.approx(4.0, rel=0.03)
    upl = code_client_data(np.ones((1, 2)) * 0.1, np.array([[3.0, 4.0]]), num_coded_rows=50000,
                           stddev=1e-9, row_l2_bound=1.0, label_stddev=1e-9, label_l2_bound=1.0,
                           categorical_labels=False, rng=np.random.default_rng(3))
    assert np.mean(np.sum(upl.coded_labels**2, axis=1)) == pytest.approx(1.0, rel=0.03)


def test_paper_mode_and_zero_label_noise():
    paper = _code(label_mode=LabelMode.PAPER_NOISELESS)
    zero = _code(label_stddev=0.0)
    assert paper.event.label_mode is LabelMode.PAPER_NOISELESS
    assert zero.event.label_mode is LabelMode.PAPER_NOISELESS  # sigma_y = 0 is the paper's
    assert np.array_equal(paper.coded_labels, zero.coded_labels)
    assert midp_coded_release(paper.event).labels_fully_disclosed
    cont = _code(y=RNG.normal(size=(7, 2)), categorical_labels=False, label_stddev=0.0)
    assert midp_coded_release(cont.event).nats == math.inf


def test_secure_mode_and_float32():
    up = _code(rng=SecureRandom())
    assert up.coded_features.shape == (6, 3)
    f32 = _code(dtype=np.float32)
    assert f32.coded_features.dtype == np.float32
    with pytest.raises(InvalidParameterError, match="dtype"):
        _code(rng=SecureRandom(), dtype=np.float32)


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_coded_rows=0), "num_coded_rows"), (dict(num_coded_rows=-3), "num_coded_rows"),
    (dict(stddev=-0.1), "stddev"), (dict(stddev=math.nan), "stddev"),
    (dict(row_l2_bound=0.0), "row_l2_bound"), (dict(label_stddev=math.nan), "label_stddev"),
    (dict(y=Y[:3]), "labels.shape"), (dict(y=Y * 0.5), "labels"),
    (dict(y=RNG.normal(size=(7, 2)), categorical_labels=False), "label_l2_bound"),
    (dict(x=np.full((7, 3), np.nan)), "features"), (dict(rng=7), "rng"),
    (dict(x=np.ones(3)), "features.shape"),
])
def test_bad_input(kwargs, name):
    with pytest.raises(InvalidParameterError, match=name):
        _code(**kwargs)


def test_sum_uploads_checks_shapes():
    with pytest.raises(InvalidParameterError):
        sum_uploads({})
    with pytest.raises(InvalidParameterError):
        sum_uploads({"a": _code(), "b": _code(num_coded_rows=5)})
