"""Validators: NaN never passes, messages name the argument and value."""

import math

import numpy as np
import pytest

from privkit import _validate as v
from privkit.errors import InvalidParameterError


@pytest.mark.parametrize("fn,bad", [
    (v.positive, math.nan), (v.positive, 0.0), (v.positive, -1), (v.positive, math.inf),
    (v.nonnegative, -1e-300), (v.nonnegative, math.nan), (v.delta, 0), (v.delta, 1),
    (v.probability, 0), (v.probability, 1.0000001), (v.positive_int, 1.5), (v.positive_int, 0),
    (v.positive_int, True), (v.positive, "1"), (v.positive, None), (v.positive_or_inf, math.nan),
])
def test_rejects(fn, bad):
    with pytest.raises(InvalidParameterError) as info:
        fn("thing", bad)
    assert str(info.value).startswith("thing must be")
    assert isinstance(info.value, ValueError)


def test_accepts_and_converts():
    assert v.positive_int("n", 1e3) == 1000 and isinstance(v.positive_int("n", np.int64(3)), int)
    assert v.probability("q", 1) == 1.0
    assert v.positive_or_inf("x", math.inf) == math.inf


def test_arrays():
    with pytest.raises(InvalidParameterError, match="sizes"):
        v.positive_array("sizes", [1.0, math.nan])
    with pytest.raises(InvalidParameterError, match="counts"):
        v.positive_int_array("counts", [1, 2.5])
    assert v.positive_int_array("counts", [1, 2]).dtype == np.int64
