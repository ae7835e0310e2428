"""``privkit midp coded``: MI-DP in nats (never an epsilon), label modes, one-line errors."""

import json
import math

import pytest

from privkit.cli import main

BASE = ["midp", "coded", "--rows", "1000", "--noise-stddev", "4", "--norm-bound", "1",
        "--dim", "784"]


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_features_only_json(capsys):
    code, out, _ = run([*BASE, "--json"], capsys)
    obj = json.loads(out)
    assert code == 0 and obj["mi_dp_nats"] == pytest.approx(0.936444, rel=5e-6)
    assert obj["mi_dp_bits"] == pytest.approx(0.936444 / math.log(2), rel=5e-6)
    assert obj["label_mode"] == "none" and "epsilon" not in obj
    assert "per-epoch client gradients unprotected" in obj["covers"]


def test_noisy_labels_default_and_paper_mode(capsys):
    _, out, _ = run([*BASE, "--label-dim", "10", "--json"], capsys)
    obj = json.loads(out)
    assert obj["mi_dp_nats"] == pytest.approx(3.60356, rel=5e-6)
    assert obj["label_mode"] == "noisy" and not obj["labels_fully_disclosed"]
    _, out, _ = run([*BASE, "--label-dim", "10", "--label-noise-stddev", "0", "--json"], capsys)
    obj = json.loads(out)
    assert obj["label_mode"] == "paper_noiseless" and obj["labels_fully_disclosed"]
    assert obj["mi_dp_nats"] == pytest.approx(32.36945, rel=1e-6)  # never 0.936444
    code, out, _ = run([*BASE, "--label-dim", "2", "--label-noise-stddev", "0", "--label-kind",
                        "continuous"], capsys)
    assert code == 0 and "inf nats" in out and "labels fully disclosed" in out


def test_text_and_bits(capsys):
    code, out, _ = run([*BASE, "--bits"], capsys)
    assert code == 0 and "bits per record" in out and "not an epsilon" in out
    assert "coded upload only" in out


@pytest.mark.parametrize("extra,name", [
    (["--rows", "0"], "--rows"), (["--noise-stddev", "-1"], "--noise-stddev"),
    (["--noise-stddev", "nan"], "--noise-stddev"), (["--dim", "2.5"], "--dim"),
    (["--label-norm-bound", "2"], "--label-norm-bound"),
    (["--label-dim", "3", "--label-kind", "continuous"], "--label-norm-bound"),
])
def test_bad_input_one_line_exit_2(extra, name, capsys):
    code, out, err = run([*BASE, *extra], capsys)
    assert code == 2 and out == "" and name in err and len(err.strip().splitlines()) == 1
