"""The Gaussian twin of ``bench/distributed.py`` (its ``twin`` section), on which the docs'
decomposition of distributed DP's gap to central DP rests: the twin must draw exactly central
DP's noise (else its gap to central DP is not the encoding's), and the total-variation bound
from the twin to distributed DP must be the distance it says."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import distributed as bench  # noqa: E402

from fl_examples.core.data import parse_dataset_spec  # noqa: E402
from fl_examples.core.distributed import DistributedDpPlan  # noqa: E402
from fl_examples.upcycled import UpcycledConfig, run_algorithm  # noqa: E402


@pytest.mark.parametrize("variance", [20.0, 500.0, 5000.0])
def test_tv_matches_brute_force(variance: float) -> None:
    from scipy.stats import norm, skellam

    sd = math.sqrt(variance)
    k = np.arange(-int(50 * sd), int(50 * sd) + 1)
    sk = skellam.pmf(k, variance / 2, variance / 2)
    g = norm.cdf((k + 0.5) / sd) - norm.cdf((k - 0.5) / sd)
    brute = 0.5 * float(np.abs(sk - g).sum())
    assert bench.skellam_rounded_gaussian_tv(variance) == pytest.approx(brute, rel=1e-8)
    # the size the docs quote: 0.073 / V per coordinate
    assert 0.06 / variance < brute < 0.09 / variance


def _flat(model: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in model.values()])


@pytest.mark.parametrize("bits", [16, 20])
def test_twin_draws_central_noise(bits: int) -> None:
    """Every client every round (no skips): the twin differs from central DP at its z by the
    rounding alone, orders of magnitude below one round's noise; an independent draw would
    put them a noise's norm apart."""
    ds = parse_dataset_spec("digits:iid@20", seed=0)
    base = bench._base("digits:iid@20", 1.0, 1.0, 1, 16, 0.1) | {"seed": 3, "iterations": 4}
    cfg = UpcycledConfig(**base, noise_multiplier=2.0, aggregation="distributed", bits=bits)
    with bench.gaussian_twin():
        twin = run_algorithm("fedavg", cfg, ds, iterations=4)
    z = float(twin["privacy"]["mean_released_noise_multiplier"])
    central = run_algorithm("fedavg", UpcycledConfig(**base, noise_multiplier=z,
                                                     adaptive_clip=0.0), ds, iterations=4)
    gap = float((_flat(twin["model"]) - _flat(central["model"])).norm())
    noise = z * 1.0 / 20 * math.sqrt(_flat(central["model"]).numel())  # one round's, in w
    assert gap < 0.02 * noise
    assert DistributedDpPlan.release is not bench._twin_release  # the patch is undone
