"""Errors that used to blame the wrong thing, refuse a valid spelling, or crash: each with
the input that showed it."""

from __future__ import annotations

import math

import pytest

import privkit
from privkit.cli import main
from privkit.errors import InvalidParameterError, UnsupportedEventError
from privkit.events import (
    GaussianDpEvent,
    SampledWithoutReplacementDpEvent,
    SelfComposedDpEvent,
    as_relation,
)

WITHOUT_REPLACEMENT = SelfComposedDpEvent(
    SampledWithoutReplacementDpEvent(1000, 10, GaussianDpEvent(1.0)), 100)


@pytest.mark.parametrize("method", ["auto", "pld", "rdp"])
def test_without_replacement_under_add_remove_names_the_relation(method):
    with pytest.raises(UnsupportedEventError) as info:
        privkit.epsilon(WITHOUT_REPLACEMENT, 1e-5, method)
    msg = str(info.value)
    assert "REPLACE_ONE" in msg and "too extreme" not in msg


def test_without_replacement_under_replace_one_is_priced_and_labelled_honestly():
    r = privkit.epsilon(WITHOUT_REPLACEMENT, 1e-5, neighboring_relation="replace-one")
    assert math.isfinite(r.epsilon) and r.neighboring_relation == "REPLACE_ONE"
    assert "too extreme" not in r.method  # PLD has no rule for it; it is not 'extreme'


@pytest.mark.parametrize("spelling,name", [
    ("replace-one", "REPLACE_ONE"), ("REPLACE_ONE", "REPLACE_ONE"), ("replace_one", "REPLACE_ONE"),
    ("add-remove", "ADD_OR_REMOVE_ONE"), ("add_or_remove_one", "ADD_OR_REMOVE_ONE"),
    (" Add-Remove ", "ADD_OR_REMOVE_ONE"),
])
def test_relation_spellings(spelling, name):
    assert as_relation(spelling).name == name
    r = privkit.epsilon(SelfComposedDpEvent(
        privkit.events.PoissonSampledDpEvent(0.1, GaussianDpEvent(1.0)), 10), 1e-5,
        neighboring_relation=spelling)
    assert r.neighboring_relation == name


def test_cli_spelling_of_the_relation_works_in_the_mechanisms():
    mech = privkit.ClientLevelGaussian(l2_clip_norm=1.0, noise_multiplier=1.0)
    assert mech.event(neighboring_relation="replace-one") == \
        mech.event(neighboring_relation=privkit.NeighboringRelation.REPLACE_ONE)


@pytest.mark.parametrize("bad", ["replace", "", None, 3, "add-or-replace"])
def test_unknown_relation_is_named(bad):
    with pytest.raises(InvalidParameterError, match="neighboring_relation"):
        as_relation(bad)


def test_epsilon_report_compares_with_numbers():
    r = privkit.epsilon(GaussianDpEvent(1.0), 1e-5)  # about 4.4
    assert r < 5 and r <= 5 and r > 4 and r >= 4 and not r < 2 and 2 < r
    assert r < privkit.epsilon(GaussianDpEvent(0.5), 1e-5)
    assert sorted([r, 3.0, 10]) [1] is r
    with pytest.raises(InvalidParameterError, match="same delta"):
        _ = r < privkit.epsilon(GaussianDpEvent(0.5), 1e-6)
    with pytest.raises(TypeError):
        _ = r < "2"
    with pytest.raises(TypeError):
        _ = r < True


def test_epsilon_gaussian_lists_only_methods_it_can_use(capsys):
    with pytest.raises(SystemExit) as info:
        main(["epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "10",
              "--delta", "1e-5", "--method", "basic"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "'basic'" in err and "'optimal'" not in err.split(
        "choose from")[1]


@pytest.mark.parametrize("argv", [
    ["epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5",
     "--sampling-probability", "0.1", "--method", "exact"],
    ["calibrate", "gaussian", "--target-epsilon", "2", "--delta", "1e-5", "--steps", "30",
     "--sampling-probability", "0.01", "--method", "moments"],
    ["calibrate", "steps", "--target-epsilon", "2", "--delta", "1e-5", "--noise-multiplier",
     "1", "--batch-size", "10", "--dataset-size", "1000", "--method", "exact"],
])
def test_unsampled_only_methods_with_sampling_name_the_method_flag(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--method" in err[0] and "without sampling" in err[0]


def test_calibrate_by_epochs_needs_no_steps(capsys):
    assert main(["calibrate", "gaussian", "--target-epsilon", "2", "--delta", "1e-5",
                 "--epochs", "3", "--sampling-probability", "0.01", "--json"]) == 0
    assert '"steps": 300' in capsys.readouterr().out


def test_integer_flags_show_the_integer_given(capsys, tmp_path):
    assert main(["train", "mapa", "--clients", "0", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("got 0") and "--clients" in err
