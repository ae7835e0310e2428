"""``--out`` is optional for every trainer: a new ``runs/<trainer>-<time>`` directory."""

from fl_examples.commands import default_out
from privkit.cli import main


def test_a_run_without_out_writes_a_new_timestamped_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "upcycled", "--dataset", "digits:3", "--rounds", "1", "--epochs", "1",
            "--device", "cpu", "--quiet"]
    assert main(argv) == 0
    assert main(argv) == 0  # a second run never lands in the first one's directory
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("upcycled-") for r in runs)
    assert all((r / "report.json").exists() for r in runs)


def test_resume_needs_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "mapa", "--rounds", "5", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "--resume" in err[0]
    assert not (tmp_path / "runs").exists()


def test_default_out_never_reuses_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = default_out("scfl", now=0.0)
    (tmp_path / first).mkdir(parents=True)
    second = default_out("scfl", now=0.0)
    assert second == first + "-2" and second.startswith("runs/scfl-")
