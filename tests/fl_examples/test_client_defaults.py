"""The client-level defaults of ``privkit train upcycled`` are the ones the docs and ``--help``
state, and adaptive clipping's count noise keeps every target reachable (no training here:
configurations, calibration and the help text only; ``bench/private_utility.py`` measures
what the defaults buy)."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest

import privkit
from fl_examples.commands import upcycled as command
from fl_examples.core.data import parse_dataset_spec
from fl_examples.core.dp_modes import (
    COUNT_NOISE_RATIO,
    adaptive_count_stddev,
    adaptive_sum_noise,
)
from fl_examples.upcycled import UpcycledConfig
from fl_examples.upcycled.config import CLIENT_DEFAULTS
from fl_examples.upcycled.privacy import _dp_plan, client_plan
from privkit.errors import InvalidParameterError
from privkit.mechanisms.aggregate import AdaptiveClipping

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "trainers" / "upcycled_private.md"


def test_dp_fedavg_defaults_are_adaptive_clipping_and_server_momentum():
    cfg = UpcycledConfig(privacy="client")
    assert cfg.mechanism == "gaussian"
    assert cfg.adaptive_clip == 0.5  # the median of the update norms
    assert cfg.l2_clip_norm == 1.0  # the initial C
    assert (cfg.server_lr, cfg.server_momentum) == (1.0, 0.5)
    assert CLIENT_DEFAULTS["gaussian"] == {"adaptive_clip": 0.5, "server_momentum": 0.5}


def test_banded_mf_defaults_keep_a_fixed_clip_and_no_momentum():
    cfg = UpcycledConfig(privacy="client", mechanism="bandmf")
    assert cfg.adaptive_clip is None and cfg.server_momentum == 0.0 and cfg.server_lr == 1.0
    assert UpcycledConfig(privacy="client", mechanism="bandmf", adaptive_clip=0).adaptive_clip == 0
    with pytest.raises(InvalidParameterError, match="adaptive_clip.*bandmf"):
        UpcycledConfig(privacy="client", mechanism="bandmf", adaptive_clip=0.5)


def test_given_settings_win_and_zero_fixes_the_clip_norm():
    cfg = UpcycledConfig(privacy="client", adaptive_clip=0, server_momentum=0.0, server_lr=2.0,
                         l2_clip_norm=3.0)
    assert (cfg.adaptive_clip, cfg.server_momentum, cfg.server_lr) == (0, 0.0, 2.0)
    ds = parse_dataset_spec("digits:3", seed=0)
    assert client_plan(cfg, ds).adaptive is None
    assert client_plan(UpcycledConfig(privacy="client"), ds).adaptive is not None
    for bad in (-0.1, 1.0):
        with pytest.raises(InvalidParameterError, match="adaptive_clip"):
            UpcycledConfig(privacy="client", adaptive_clip=bad)
    # the other privacy models have no client-level settings to fill
    for kind in ("none", "record", "output"):
        c = UpcycledConfig(privacy=kind)
        assert c.adaptive_clip is None and c.server_momentum is None


def _help() -> dict[str, str]:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return {opt: a.help or "" for a in p._actions for opt in a.option_strings}


def test_help_states_the_defaults():
    h = _help()
    assert "default 0.5 with --mechanism gaussian, 0 with bandmf" in h["--server-momentum"]
    assert "default 0.5" in h["--adaptive-clip"] and "0: a fixed --clip" in h["--adaptive-clip"]
    assert "default 1)" in h["--server-lr"]
    assert "the initial C under adaptive clipping" in h["--clip"]


def test_the_docs_table_of_defaults_is_the_configuration():
    """docs/trainers/upcycled_private.md's table of client-level defaults, row by row."""
    text = PAGE.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(--[a-z-]+)` \| default: ([^|]+?) \|", text, re.M))
    cfg = UpcycledConfig(privacy="client")
    banded = UpcycledConfig(privacy="client", mechanism="bandmf")
    assert rows["--adaptive-clip"] == (f"{cfg.adaptive_clip:g} (gaussian); none, a fixed "
                                       "clip (bandmf)")
    assert rows["--server-momentum"] == (f"{cfg.server_momentum:g} (gaussian); "
                                         f"{banded.server_momentum:g} (bandmf)")
    assert rows["--server-lr"] == f"{cfg.server_lr:g}"
    assert rows["--clip"] == f"{cfg.l2_clip_norm:g} (the initial C under adaptive clipping)"


@pytest.mark.parametrize("m", [1.0, 9.0, 15.0, 20.0, 100.0, 1e4])
@pytest.mark.parametrize("joint", [1e-200, 0.3, 0.86, 1.3, 3.1, 50.0])
def test_the_count_noise_leaves_every_joint_target_reachable(m, joint):
    """The sum's z for a joint target: with the count's stddev max(m / 20, 2.5 z) the round's
    joint multiplier is the target (no overflow for tiny z), and the count takes at most
    a factor sqrt(1 + 1/25) of the sum's noise."""
    z = adaptive_sum_noise(m, joint)
    sd = adaptive_count_stddev(m, z)
    ac = AdaptiveClipping(0.5, count_stddev=sd, sampling_probability=0.5)
    assert ac.joint_noise_multiplier(z) == pytest.approx(joint, rel=1e-12)
    assert joint <= z <= joint * math.sqrt(1 + COUNT_NOISE_RATIO ** -2) * (1 + 1e-12)
    assert sd >= m / 20 and 2 * sd >= COUNT_NOISE_RATIO * z * (1 - 1e-12)


def test_the_default_run_calibrates_where_the_old_count_noise_could_not():
    """The trainer's default data set (30 clients, fraction 0.3, 80 data rounds) at epsilon
    4: the round needs z ~ 3.1, above the 1.8 that q N / 20 left the count; now the run's
    epsilon is the target, and the count is one joint release."""
    cfg = UpcycledConfig(privacy="client", noise_for_epsilon=4.0)
    ds = parse_dataset_spec(cfg.dataset, seed=0)
    plan, info = _dp_plan("upcycled", cfg, ds, cfg.iterations)
    assert plan.adaptive is not None and plan.adaptive.count_stddev > 0.3 * 30 / 20
    eps = privkit.epsilon(privkit.SelfComposedDpEvent(plan.round_event(), 80), 1e-5).epsilon
    assert 3.99 < eps <= 4.0 * (1 + 1e-9)
    assert info["calibrated"]["planned_epsilon"] == pytest.approx(eps)
    assert plan.noise_multiplier == pytest.approx(
        plan.effective_noise_multiplier * math.sqrt(1 + COUNT_NOISE_RATIO ** -2))
