"""One vocabulary across the trainers: the same concept has the same flag in every trainer,
the older spellings still work (with a one-line note naming the new flag), and errors name
the new flag."""

from __future__ import annotations

import argparse

import pytest

from fl_examples.commands import VOCABULARY, command_modules, split_algorithms
from privkit.errors import InvalidParameterError


def _parser(module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"privkit train {module.__name__.rsplit('.', 1)[1]}")
    module.add_arguments(p)
    return p


PARSERS = {m.__name__.rsplit(".", 1)[1]: _parser(m) for m in command_modules()}

# (trainer, old spelling, new flag, value, namespace attribute)
RENAMED = [
    ("upcycled", "--iterations", "--rounds", "12", "rounds"),
    ("mapa", "--edges", "--clients", "7", "clients"),
    ("mapa", "--updates", "--rounds", "12", "rounds"),
    ("mapa", "--epsilon", "--upload-epsilon", "2", "upload_epsilon"),
    ("scfl", "--gradient-clip", "--clip", "2", "clip"),
    ("scfl", "--gradient-noise-multiplier", "--noise-multiplier", "2", "noise_multiplier"),
    ("scfl", "--gradient-noise-for-epsilon", "--noise-for-epsilon", "2", "noise_for_epsilon"),
    ("dprec", "--l2-clip", "--clip", "2", "clip"),
    ("dprec", "--dpfedavg-noise", "--noise-multiplier", "2", "noise_multiplier"),
    ("dprec", "--epsilon", "--noise-for-epsilon", "2", "noise_for_epsilon"),
]


@pytest.mark.parametrize("trainer,old,new,value,dest", RENAMED,
                         ids=[f"{r[0]}{r[1]}" for r in RENAMED])
def test_old_spelling_works_and_notes_the_new_flag(trainer, old, new, value, dest, capsys):
    p = PARSERS[trainer]
    with_new = p.parse_args([new, value])
    assert capsys.readouterr().err == ""
    with_old = p.parse_args([old, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert getattr(with_old, dest) == getattr(with_new, dest)
    assert getattr(with_old, dest) != getattr(p.parse_args([]), dest)  # the value went through
    assert err == [f"privkit: {old} is now {new} (the old spelling still works)"]


@pytest.mark.parametrize("trainer", ["upcycled", "mapa", "scfl", "dprec"])
def test_every_trainer_has_the_run_length_flag(trainer):
    flags = {s for a in PARSERS[trainer]._actions for s in a.option_strings}
    assert VOCABULARY["run length"][0] in flags and VOCABULARY["delta"][0] in flags


def test_shared_concepts_have_one_flag_in_every_trainer_that_has_them():
    for concept in ("clip", "noise multiplier", "epsilon target"):
        flag = VOCABULARY[concept][0]
        having = [t for t, p in PARSERS.items()
                  if any(flag in a.option_strings for a in p._actions)]
        assert set(having) >= {"scfl", "dprec"}, (concept, having)
    for trainer in ("upcycled", "mapa", "dprec"):
        assert any("--clients" in a.option_strings for a in PARSERS[trainer]._actions)
        assert any("--algorithms" in a.option_strings for a in PARSERS[trainer]._actions)


def test_old_spellings_are_hidden_from_help():
    for trainer, p in PARSERS.items():
        text = p.format_help()
        for _, old, _, _, _ in (r for r in RENAMED if r[0] == trainer):
            # the alias is listed next to its new flag, never as an option of its own
            assert f"\n  {old} " not in text, (trainer, old)
        assert "--compare" not in text and "--algorithm " not in text, trainer


def test_algorithms_main_first_and_old_spelling_noted(capsys):
    assert split_algorithms("fedprox,fedavg", None, None, ("upcycled",),
                            ("upcycled", "fedprox", "fedavg")) == ("fedprox", ("fedavg",))
    assert capsys.readouterr().err == ""
    assert split_algorithms(None, "fedavg", "upcycled", ("upcycled",)) == \
        ("fedavg", ("upcycled",))
    assert "--algorithms" in capsys.readouterr().err
    assert split_algorithms(None, None, None, ("dprec", "dpfedavg")) == ("dprec", ("dpfedavg",))


@pytest.mark.parametrize("value,why", [
    ("upcycled,scaffold", "one of"), ("", "at least one"), ("fedavg,fedavg", "once"),
])
def test_bad_algorithms_name_the_flag(value, why):
    with pytest.raises(InvalidParameterError, match=f"algorithms.*{why}"):
        split_algorithms(value, None, None, ("upcycled",), ("upcycled", "fedprox", "fedavg"))


def test_both_spellings_together_are_refused():
    with pytest.raises(InvalidParameterError, match="algorithms"):
        split_algorithms("upcycled", "fedavg", None, ("upcycled",))


@pytest.mark.parametrize("trainer", ["upcycled", "mapa", "scfl", "dprec"])
def test_every_trainer_takes_device_with_one_default(trainer):
    p = PARSERS[trainer]
    assert any(VOCABULARY["device"][0] in a.option_strings for a in p._actions)
    assert p.parse_args([]).device == "auto"
    assert p.parse_args(["--device", "cpu"]).device == "cpu"


def test_scfl_runs_on_the_cpu_and_refuses_a_gpu_in_one_line(tmp_path, capsys):
    from fl_examples.commands.scfl import check_device
    from privkit.cli import main

    assert check_device("auto") == check_device("cpu") == check_device("CPU") == "cpu"
    with pytest.raises(InvalidParameterError, match="device"):
        check_device("cuda:0")
    code = main(["train", "scfl", "--device", "cuda", "--rounds", "1", "--out",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["privkit: error: --device must be auto or cpu (SCFL computes "
                                 "in numpy on the CPU; it has no GPU path), got 'cuda'"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("trainer", ["mapa", "scfl", "dprec"])
def test_delta_defaults_to_1e_5(trainer):
    assert PARSERS[trainer].parse_args([]).delta == 1e-5


def test_mapa_keeps_the_papers_theorem3_delta_under_its_own_flag():
    p = PARSERS["mapa"]
    assert p.parse_args([]).theorem3_delta is None  # MapaConfig: the paper's 1e-3
    assert p.parse_args(["--theorem3-delta", "1e-3"]).theorem3_delta == 1e-3
    text = " ".join(p.format_help().split())
    assert "default 1e-3, the paper's testbed setting" in text
    assert "the delta of every reported epsilon" in text and "(default 1e-5, as in every" in text


def test_dprec_clients_per_round_follows_the_clients(tmp_path):
    from fl_examples.commands.dprec import prepare
    from fl_examples.dprec import DPRecConfig

    p = PARSERS["dprec"]
    assert p.parse_args([]).clients_per_round is None
    assert "min(30, N)" in " ".join(p.format_help().split())
    # --clients 20 alone is a run (it was "--clients-per-round must be at most 20")
    args = p.parse_args(["--clients", "20", "--out", str(tmp_path / "run")])
    args.trainer, args.secure_noise, args.eval_client_data = "dprec", False, False
    assert callable(prepare(args)) and not (tmp_path / "run").exists()
    assert DPRecConfig(clients=20).for_clients(20).clients_per_round == 20
    assert DPRecConfig().for_clients(100).clients_per_round == 30
    assert DPRecConfig(clients_per_round=4).for_clients(100).clients_per_round == 4
    assert DPRecConfig(clients=20).client_rate_for(20) == 1.0
