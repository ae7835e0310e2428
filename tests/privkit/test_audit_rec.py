"""The REC audit: the real mechanism passes, 0.8x-noise and 4x-sharper-target mutants fail.

Setting (privkit/audit/rec.py): K = 64, c = C/sigma = 0.5 per one-coordinate group, claim
D_2 <= 1.0225; statistic: the view's log-likelihood ratio, binned. Measured over fresh seeds
(the module's table): at 1e5 draws the real mechanism's lower bound stayed below the claim and
the 0.8x-noise mutant's above it; at 2000-4000 draws (too few for 0.8x) the 4x mutant is caught.
"""

import json

import pytest

from privkit import audit as A
from privkit.errors import InvalidParameterError


def test_real_rec_passes():
    r = A.audit("rec", trials=2000, seed=1)
    assert r.passed and r.mechanism == "rec"
    assert 0.1 < r.empirical_epsilon_lower < r.claimed_epsilon
    assert r.claimed_epsilon == pytest.approx(1.0225, abs=1e-4)
    assert r.details["num_candidates"] == 64
    assert r.details["d2_lower"] <= r.details["d2_exact_view"]
    json.dumps(r.to_dict())


def test_sharper_target_mutant_fails():
    r = A.audit("rec", trials=2000, noise_scale=0.25, seed=2)
    assert not r.passed
    assert r.empirical_epsilon_lower > 2 * r.claimed_epsilon


def test_0_8x_noise_mutant_fails_at_the_default_trials():
    r = A.audit("rec", noise_scale=0.8, seed=2001)
    assert r.trials == 100_000
    assert not r.passed
    assert r.empirical_epsilon_lower > 1.05 * r.claimed_epsilon


def test_renyi_lower_bound_is_a_lower_bound():
    # identical counts: no divergence can be certified
    assert A.renyi2_lower_bound([50, 50], [50, 50], 100, 1e-3) == 0.0
    # disjoint supports: a large certified divergence
    assert A.renyi2_lower_bound([1000, 0], [0, 1000], 1000, 1e-3) > 3.0


def test_rec_audit_arguments():
    assert "rec" in A.ALL_MECHANISMS and "rec" not in A.MECHANISMS
    with pytest.raises(InvalidParameterError, match="dimension"):
        A.audit("rec", trials=100, dimension=1)


def test_cli_audit_rec_prints_the_renyi_claim(capsys):
    from privkit.cli import main

    assert main(["audit", "rec", "--trials", "1000", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "D_2 <=" in out and "PASSED" in out
