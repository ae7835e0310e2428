"""The example app (``fl_examples/flower/app``) and its loopback deployment script.

The app's default run config is client-level DP calibrated to epsilon <= 8 at delta 1e-5 on
100 clients; the deployment test starts a SuperLink and two SuperNodes on 127.0.0.1, runs the
app with ``flwr run`` and checks that every process it started is gone (about 1 minute on two
busy cores; bounded at 240 s).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXTRA = "install the flower extra: pip install -e '.[flower]' from a checkout"
pytest.importorskip("flwr", reason=f"Flower is not installed; {EXTRA}")
tomllib = pytest.importorskip("tomllib", reason="reading the app's pyproject needs Python 3.11")

from flwr.app import Context, RecordDict  # noqa: E402

import privkit  # noqa: E402
from fl_examples.flower import PrivkitFedProx, load_federated  # noqa: E402
from fl_examples.flower import deploy_loopback as deploy  # noqa: E402
from fl_examples.flower.app import server_app  # noqa: E402
from privkit.errors import InvalidParameterError  # noqa: E402
from privkit.flower import ClientLevelDP  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
APP = ROOT / "fl_examples" / "flower" / "app"
SCRIPT = ROOT / "fl_examples" / "flower" / "deploy_loopback.py"


def app_config(**overrides):
    cfg = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return cfg | overrides


def context(**overrides):
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config=app_config(**overrides))


def test_default_config_is_client_level_dp_within_epsilon_8():
    rc = app_config()
    assert rc["privacy"] == "client" and rc["reference"] is True and rc["delta"] == 1e-5
    assert load_federated(rc["dataset"], rc["seed"], rc["num-clients"]).num_clients == 100
    dp = server_app.strategy_from_config(context())
    assert isinstance(dp, ClientLevelDP) and isinstance(dp.strategy, PrivkitFedProx)
    assert dp.strategy.fraction_train == 1.0 and dp.client_rate == rc["fraction"]
    rounds = server_app.data_rounds(rc["algorithm"], rc["num-rounds"])
    eps = float(privkit.epsilon(privkit.SelfComposedDpEvent(dp.event, rounds), 1e-5))
    assert 7.9 < eps <= rc["target-epsilon"] == 8.0
    assert dp.max_epsilon == 8.0  # a rerun on the same ledger stops instead of exceeding
    reference = server_app.strategy_from_config(context(), "none")
    assert type(reference) is PrivkitFedProx and reference.fraction_train == rc["fraction"]


def test_upcycled_calibrates_for_its_odd_rounds_only():
    dp = server_app.strategy_from_config(context(algorithm="upcycled", **{"num-rounds": 7}))
    assert server_app.data_rounds("upcycled", 7) == 4
    assert float(privkit.epsilon(privkit.SelfComposedDpEvent(dp.event, 4), 1e-5)) <= 8.0
    fixed = server_app.strategy_from_config(context(**{"noise-multiplier": 2.0}))
    assert fixed.mechanism.noise_multiplier == 2.0 and fixed.max_epsilon is None


def test_evaluation_is_on_the_server_by_default():
    """No evaluate messages (fraction_evaluate 0) and a server-side evaluate_fn; a bad value
    of ``evaluation`` names it."""
    dp = server_app.strategy_from_config(context())
    assert dp.strategy.fraction_evaluate == 0.0
    metrics = server_app.evaluate_fn_from_config(context())(
        0, server_app.initial_from_config(context()))
    assert metrics["num-examples"] > 0 and 0.0 <= metrics["accuracy"] <= 1.0
    clients = context(evaluation="clients")
    assert server_app.evaluate_fn_from_config(clients) is None
    assert server_app.strategy_from_config(clients).strategy.fraction_evaluate == 1.0
    with pytest.raises(InvalidParameterError, match="evaluation"):
        server_app.strategy_from_config(context(evaluation="both"))


def test_log_echo_prints_a_reattached_stream_once(tmp_path, capsys):
    """The log stream of ``flwr run`` may end before the run does; the reattached
    ``flwr log --stream`` repeats the run's log from its start, and only the new part is
    echoed."""
    mark = "INFO :      Starting logstream for run_id `42`\n"
    first = tmp_path / "run.log"
    first.write_text("Using SuperLink: loopback\nSuccessfully started run 42\n" + mark
                     + "round 1\n")
    again = tmp_path / "log.log"
    again.write_text(mark + "round 1\nround 2\ndone\n")
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    echo = deploy.LogEcho()
    echo.follow(first, done, time.monotonic(), 10.0)
    assert echo.run_id == 42
    echo.follow(again, done, time.monotonic(), 10.0)
    out = capsys.readouterr().out
    assert out == ("Using SuperLink: loopback\nSuccessfully started run 42\n" + mark
                   + "round 1\nround 2\ndone\n")


def test_taken_port_fails_in_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert deploy.main(["--port", str(port), "--supernodes", "1"]) == 3
    err = capsys.readouterr().err
    assert f"SuperLink port 127.0.0.1:{port} is not free" in err.splitlines()[0]


def test_bounded_wait_names_the_step(tmp_path):
    dep = deploy.Deployment(tmp_path, wait=0.5)
    t0 = time.monotonic()
    with pytest.raises(deploy.DeployError, match="SuperLink on x: not ready within 0.5 s"):
        dep.wait_until("SuperLink on x", lambda: False)
    assert time.monotonic() - t0 < 3


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_loopback_deployment_runs_the_app_and_stops_everything(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--supernodes", "2", "--port", "0", "--home",
            str(home), "--wait", "90", "--run-config",
            f"num-rounds=2 local-epochs=1 fraction=1.0 reference=false out-dir='{out}'"]
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    finally:
        left = deploy.leftovers(home)
        for pid in left:  # never leave processes behind, even if the test fails
            os.kill(pid, 9)
    seconds = time.monotonic() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run status: finished:completed" in done.stdout
    assert "client-level epsilon" in done.stdout
    assert left == []
    pids = [int(p) for p in (home / "pids").read_text().split()]
    assert len(pids) == 4  # SuperLink, two SuperNodes, flwr run
    assert not any(_alive(p) for p in pids)
    result = json.loads((out / "flower-result.json").read_text())["private"]
    privacy = result["privacy"]
    assert privacy["delta"] == 1e-5 and 0 < privacy["epsilon"] <= 8.0
    assert result["train_metrics"]["2"]["privkit-epsilon"] == pytest.approx(privacy["epsilon"])
    assert 0.0 <= result["accuracy"] <= 1.0
    assert seconds < 240


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_ctrl_c_stops_everything(tmp_path):
    home = tmp_path / "home"
    argv = [sys.executable, str(SCRIPT), "--supernodes", "2", "--port", "0", "--home",
            str(home), "--wait", "90", "--run-config", "num-rounds=50 reference=false"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # interrupt once the deployment is up
            if "SuperNodes online" in line or time.monotonic() > deadline:
                break
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        # the script's own teardown is bounded at about 60 s (10 s for SIGTERM, 5 s per
        # SIGKILLed process, 10 s for Flower's detached helpers, 10 s for their signals);
        # under a loaded machine it can use all of it
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = deploy.leftovers(home)
        for pid in left:
            os.kill(pid, 9)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; stopped every process it started" in err
    assert left == []
    assert not any(_alive(int(p)) for p in (home / "pids").read_text().split())
