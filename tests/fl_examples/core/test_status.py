"""The status line of slow silent phases (fl_examples.core.status), every trainer's
calibration wired to it, and ``privkit demo`` without the examples extra saying so at once."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io

import numpy as np
import pytest

from fl_examples.core import status as status_mod
from fl_examples.core.report import quiet
from fl_examples.core.status import shown, status


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _no_tqdm_disable(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


def test_a_status_line_says_what_starts_then_its_result_and_time() -> None:
    term = _Terminal()
    with status("calibrating z to epsilon 8 (delta 1e-05, 100 rounds)", stream=term) as line:
        line.done("z = 0.656")
    text = term.getvalue()
    assert text.startswith("privkit: calibrating z to epsilon 8 (delta 1e-05, 100 rounds)...")
    assert text.endswith(" s)\n") and " z = 0.656 (" in text and text.count("\n") == 1
    assert line.seconds >= 0 and line.result == "z = 0.656"


def test_a_failed_phase_erases_its_line_and_the_error_goes_through() -> None:
    term = _Terminal()
    with pytest.raises(ValueError, match="unreachable"):
        with status("calibrating", stream=term):
            raise ValueError("unreachable")
    assert term.getvalue() == "privkit: calibrating...\r\x1b[K"  # nothing left on screen


def test_shown_on_a_terminal_only_and_never_when_quiet(monkeypatch) -> None:
    plain = io.StringIO()  # a pipe or a log: no status line (like the progress bar)
    with status("calibrating", stream=plain) as line:
        line.done("z = 1")
    assert plain.getvalue() == "" and line.result == "z = 1"
    assert shown(_Terminal())
    with quiet():  # --quiet
        assert not shown(_Terminal())
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not shown(_Terminal())
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert shown(_Terminal())


@pytest.fixture()
def terminal(monkeypatch):
    """Status lines printed to stderr as on a terminal."""
    monkeypatch.setattr(status_mod, "shown", lambda stream=None: True)


def test_upcycled_calibrations_say_so(terminal, capsys) -> None:
    from fl_examples.core.data import parse_dataset_spec
    from fl_examples.upcycled import UpcycledConfig
    from fl_examples.upcycled.privacy import _privacy_plan

    ds = parse_dataset_spec("digits:3", seed=2)
    base = dict(dataset="digits:3", local_epochs=1, batch_size=32, device="cpu", fraction=0.5,
                stragglers=0.0, seed=2, mu=0.1, lam=0.04, iterations=4, noise_for_epsilon=4.0)
    for kind, extra, what in [("output", {}, "sigma"),
                              ("client", {"client_rate": 0.5, "l2_clip_norm": 1.0}, "z"),
                              ("record", {"l2_clip_norm": 1.0}, "z")]:
        _privacy_plan("upcycled", UpcycledConfig(privacy=kind, **base, **extra), ds, 4)
        err = capsys.readouterr().err
        assert err.startswith(f"privkit: calibrating upcycled's {what} to epsilon 4 "
                              "(delta"), err
        assert "2 data rounds" in err and f" {what} = " in err and err.endswith(" s)\n")


def test_mapa_scfl_and_dprec_calibrations_say_so(terminal, capsys, monkeypatch) -> None:
    from fl_examples.core.asyncsim import simulate
    from fl_examples.mapa import MapaConfig
    from fl_examples.mapa.privacy import gaussian_noise_multiplier

    cfg = MapaConfig(dataset="digits", edges=4, batch=16, updates=20, seed=3, noise="gaussian",
                     noise_for_epsilon=3.0)
    sched = simulate(cfg.edges, cfg.updates, cfg.timing(), seed=cfg.seed)
    gaussian_noise_multiplier(cfg, sched, np.full(4, 200))
    err = capsys.readouterr().err
    assert err.startswith("privkit: calibrating z to epsilon 3 (delta 1e-05, max over 4 "
                          "edges, up to ") and " z = " in err

    from fl_examples.scfl import ScflConfig
    from fl_examples.scfl.run import _GradientDp

    scfl = ScflConfig(dataset="digits:3", clients=3, rounds=5, batch_sampling="bernoulli",
                      gradient_noise_for_epsilon=2.0)
    _GradientDp.plan(scfl, ("0", "1", "2"), np.array([50, 60, 70]), np.array([16, 16, 16]),
                     np.ones(3, dtype=bool))
    err = capsys.readouterr().err
    assert err.startswith("privkit: calibrating the gradients' z to epsilon 2 (delta 1e-05, "
                          "5 rounds, max over clients)...") and " z = " in err

    import fl_examples.dprec as dprec
    from fl_examples.dprec import DPRecConfig

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(dprec, "calibrate_dprec", lambda *a: 0.7)  # the slow one: its line
    monkeypatch.setattr(dprec, "run_algorithm", stop)
    with pytest.raises(Stop):
        dprec.train(DPRecConfig(clients=10, clients_per_round=3, rounds=2, device="cpu",
                                epsilon=8.0), compare=("dpfedavg",))
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("privkit: calibrating DP-REC's noise to central epsilon 8 (delta "
                             "1e-05, 2 rounds)... stddev = 0.7 (")
    assert err[1].startswith("privkit: calibrating DP-FedAvg's z to central epsilon 8 ")


def test_quiet_runs_print_no_status_line(capsys) -> None:
    from fl_examples.core.data import parse_dataset_spec
    from fl_examples.upcycled import UpcycledConfig
    from fl_examples.upcycled.privacy import _privacy_plan

    cfg = UpcycledConfig(dataset="digits:3", privacy="output", iterations=2, seed=2,
                         noise_for_epsilon=4.0, device="cpu")
    _privacy_plan("upcycled", cfg, parse_dataset_spec("digits:3", seed=2), 2)
    assert capsys.readouterr().err == ""  # captured stderr is not a terminal


# ------------------------------------------------- privkit demo without the examples extra
def test_demo_without_the_trainers_says_so_at_once(monkeypatch, capsys, tmp_path) -> None:
    from privkit.cli import main

    real = importlib.metadata.EntryPoint.load

    def load(self):
        if self.group == "privkit.commands":
            raise ImportError("No module named 'fl_examples'", name="fl_examples")
        return real(self)

    monkeypatch.setattr(importlib.metadata.EntryPoint, "load", load)
    assert main(["demo", "--out", str(tmp_path / "d")]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing half-printed before the error
    (line,) = err.strip().splitlines()
    assert line.startswith("privkit: 'demo' needs the bundled trainers: ")
    assert "pip install -e '.[examples]'" in line and "pip install privkit" not in line
    assert main(["demo", "--json", "--out", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().out == ""
    assert main(["demo", "--no-train"]) == 0  # the epsilon table alone needs no extra
    assert "epsilon" in capsys.readouterr().out


def test_demo_without_torch_names_it_before_anything_else(monkeypatch, capsys,
                                                          tmp_path) -> None:
    from privkit.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    assert main(["demo", "--out", str(tmp_path / "d")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "(missing module 'torch')" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "d").exists()
