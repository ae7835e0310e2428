"""The coded-data (SCFL) MI-DP audit: the real mechanism passes, its 0.8x-noise mutant fails.

Setting (privkit/audit/coded.py): d = 1, c = 64, rho = 1, sigma = 2; claim (Theorem F) 0.16805 nats.
Measured over fresh seeds at 2e4 draws per record value per half (the tests' setting): the real
mechanism's lower bound stayed <= 0.115 nats (0/50 failures) and the 0.8x mutant's >= 0.19
(50/50 detections); see the audit module's table for 1e5.
"""

import json
import math

import numpy as np
import pytest

from privkit import audit as A
from privkit.accountants.midp import midp_coded_features
from privkit.errors import InvalidParameterError

TRIALS = 20_000


def test_real_coded_passes():
    r = A.audit("coded", trials=TRIALS, seed=11)
    assert r.passed and r.mechanism == "coded"
    assert r.claimed_epsilon == pytest.approx(midp_coded_features(64, 2.0, 1.0, 1), rel=1e-12)
    assert r.claimed_epsilon == pytest.approx(0.16805, abs=1e-5)
    assert 0.05 < r.empirical_epsilon_lower < 0.8 * r.claimed_epsilon
    assert r.details["stddev_used"] == 2.0 and r.details["mi_dp_claimed_nats"] == r.claimed_epsilon
    json.dumps(r.to_dict())


def test_coded_mutant_with_0_8x_noise_fails():
    r = A.audit("coded", trials=TRIALS, noise_scale=0.8, seed=12)
    assert not r.passed
    assert r.details["stddev_used"] == pytest.approx(1.6)
    assert r.empirical_epsilon_lower > 1.1 * r.claimed_epsilon


def test_coded_audit_is_deterministic_given_a_seed():
    a = A.audit("coded", trials=2000, seed=3)
    b = A.audit("coded", trials=2000, seed=3)
    assert a.empirical_epsilon_lower == b.empirical_epsilon_lower
    assert a.details["count_D"] == b.details["count_D"]


def test_binary_mi_lower_bound():
    # identical counts: nothing can be certified
    assert float(A.binary_mi_lower_bound(500, 500, 1000, 1e-3, 0.5)) == 0.0
    # perfectly separated: close to log 2, never above it
    v = float(A.binary_mi_lower_bound(0, 100_000, 100_000, 1e-3, 0.5))
    assert math.log(2) - 1e-3 < v <= math.log(2)
    # below the plug-in binary-channel MI, and at least Fano's bound at the CP error bound
    k0, k1, n = np.array([3000]), np.array([7000]), 10_000
    lb = float(A.binary_mi_lower_bound(k0, k1, n, 1e-3, 0.5)[0])
    p0, p1 = 0.3, 0.7
    def hb(p):
        return -p * math.log(p) - (1 - p) * math.log(1 - p)
    plug_in = hb(0.5) - 0.5 * hb(p0) - 0.5 * hb(p1)
    assert 0 < lb < plug_in
    hi0 = float(A.clopper_pearson_upper(k0, n, 5e-4)[0])
    lo1 = float(A.clopper_pearson_lower(k1, n, 5e-4)[0])
    pe = 0.5 * hi0 + 0.5 * (1 - lo1)
    assert lb >= math.log(2) - hb(pe) - 1e-12


def test_coded_audit_arguments():
    assert "coded" in A.ALL_MECHANISMS and "coded" not in A.MECHANISMS
    with pytest.raises(InvalidParameterError, match="dimension"):
        A.audit("coded", trials=100, dimension=1)
    with pytest.raises(InvalidParameterError, match="noise_scale"):
        A.audit("coded", trials=100, noise_scale=float("nan"))


def test_cli_prints_mutual_information_not_epsilon(capsys):
    from privkit.cli import main

    assert main(["audit", "coded", "--trials", "5000", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "nats" in out and "not an epsilon" in out and "eps" not in out.replace("epsilon", "")
