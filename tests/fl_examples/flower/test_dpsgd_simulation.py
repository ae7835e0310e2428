"""The documented DP-SGD simulation of the example app (DpSgdMod behind any strategy)."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="Flower is not installed (the flower extra)")

from fl_examples.core.dpsgd import DpSgdSettings, round_event, steps_per_client  # noqa: E402
from fl_examples.flower import dpsgd_simulation as sim  # noqa: E402
from fl_examples.flower import load_federated  # noqa: E402
from privkit import SelfComposedDpEvent, epsilon  # noqa: E402
from privkit.errors import InvalidParameterError  # noqa: E402


def test_dpsgd_simulation_reports_epsilon_and_both_accuracies():
    """Tiny: each client's epsilon is its composed rounds, both runs end with an accuracy, a
    bad noise multiplier names it before anything runs."""
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        sim.run(noise_multiplier=-1.0)
    res = sim.run(dataset="digits@3", clients=3, rounds=2, local_epochs=1)
    sizes = load_federated("digits@3", 0, 3).train_sizes
    s = DpSgdSettings(l2_clip_norm=1.0, noise_multiplier=2.05, batch_size=32)
    steps = steps_per_client(sizes, [1] * 3, 32).tolist()
    want = [epsilon(SelfComposedDpEvent(round_event(int(n), k, s), 2), delta=1e-5).epsilon
            for n, k in zip(sizes, steps)]
    assert res["epsilon_max"] == pytest.approx(max(want), rel=1e-12)
    for label in ("dpsgd", "non-private"):
        assert 0.0 <= res[label]["accuracy"] <= 1.0
