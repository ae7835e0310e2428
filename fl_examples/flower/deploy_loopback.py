"""Run the example app in a Flower deployment on 127.0.0.1: one SuperLink, N SuperNodes.

Loopback only, without TLS (``--insecure``): for trying the deployment path on one machine and
for tests, never across a network. What it does, each step bounded by ``--wait`` seconds:

1. writes a fresh Flower home (``FLWR_HOME``: ``config.toml`` with a ``loopback`` SuperLink
   connection, every process's log) and checks the ports are free;
2. starts the SuperLink (its state in memory: with a SQLite file, 20 SuperNodes polling at
   once made it fail with ``database is locked`` and the run with it) and waits until its
   port accepts TCP connections;
3. starts N SuperNodes (node ``i`` is client ``i``: ``--node-config partition-id=i``), waits
   until each one's Runtime API port accepts connections, then until the SuperLink's control
   API lists N nodes ``online``;
4. runs the app with ``flwr run APP loopback --stream`` and then reads the run's final status
   from the control API (``flwr ls``): exit status 0 only for ``finished:completed``;
5. always stops every process it started (also on an error, Ctrl-C or SIGTERM): SIGTERM to
   each process group, SIGKILL to what is left after 10 s.

If a step does not finish in time it prints one line saying which, the last lines of that
process's log, and exits with status 3 (2: bad arguments or Flower not installed).

Every process gets ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``: the app runs in this
Python environment (privkit and flwr installed), and the SuperLink does not build a new one
from the app's ``pyproject.toml`` with ``uv sync`` (which would need a package index).

    python fl_examples/flower/deploy_loopback.py --supernodes 3 \\
        --run-config "num-clients=3 num-rounds=2 local-epochs=2 fraction=1.0 reference=false"

The run config is passed to ``flwr run --run-config``; ``num-clients`` defaults to
``--supernodes``. ``--port 0`` picks free ports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

HOST = "127.0.0.1"
APP = Path(__file__).resolve().parent / "app"
ENV = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_TELEMETRY_ENABLED": "0",
       "FLWR_DISABLE_UPDATE_CHECK": "1"}


class DeployError(RuntimeError):
    """A step failed; the message is one line."""


class MissingTool(DeployError):
    """A Flower executable is not installed."""


def _executable(name: str) -> str:
    """``name`` next to this Python (a virtual environment's bin/), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise MissingTool(f"{name} not found next to {sys.executable} or on PATH: "
                          "pip install -e '.[flower]' from a checkout of privkit")
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _check_free(port: int, what: str) -> None:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError as exc:
            raise DeployError(f"{what} port {HOST}:{port} is not free ({exc.strerror})") from exc


def accepts(port: int) -> bool:
    """Whether 127.0.0.1:port accepts a TCP connection now."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class Deployment:
    """The processes of one loopback deployment (a context manager that stops them all)."""

    def __init__(self, home: Path, *, wait: float) -> None:
        self.home, self.wait = home, wait
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        bindir = str(Path(_executable("flower-superlink")).parent)  # it starts flower-superexec
        self.env = os.environ | ENV | {"FLWR_HOME": str(home), "PATH": os.pathsep.join(
            [bindir, os.environ.get("PATH", "")])}
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self._files: list[IO[bytes]] = []

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- processes -----------------------------------------------------------------------
    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own process group, output to ``logs/<name>.log``."""
        log = self.logs / f"{name}.log"
        f = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self._files.append(f)
        proc = subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc, log))
        with open(self.home / "pids", "a") as pids:
            pids.write(f"{proc.pid}\n")
        return proc

    def stop(self) -> None:
        """SIGTERM every started process group, then SIGKILL what is left after 10 s."""
        for _, proc, _ in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for _, proc, _ in self.procs:  # the group too: helpers a process left behind
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        # Flower detaches helpers (flower-superexec, app processes) into sessions of their
        # own; they carry this deployment's FLWR_HOME, and exit by themselves when their
        # parent is gone: give them 10 s, then stop them too.
        deadline = time.monotonic() + 10.0
        while leftovers(self.home) and time.monotonic() < deadline:
            time.sleep(0.5)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in leftovers(self.home):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            t_end = time.monotonic() + 5.0
            while leftovers(self.home) and time.monotonic() < t_end:
                time.sleep(0.2)
        for f in self._files:
            f.close()
        self._files.clear()

    def wait_until(self, what: str, ready: Any, proc: subprocess.Popen[bytes] | None = None,
                   log: Path | None = None) -> float:
        """Poll ``ready()`` until true (seconds taken); DeployError after ``wait`` seconds."""
        t0 = time.monotonic()
        while not ready():
            if proc is not None and proc.poll() is not None:
                raise DeployError(f"{what}: the process exited with status {proc.returncode}"
                                  + _log_hint(log))
            if time.monotonic() - t0 > self.wait:
                raise DeployError(f"{what}: not ready within {self.wait:g} s" + _log_hint(log))
            time.sleep(0.5)
        return time.monotonic() - t0

    # -- control API ---------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_executable("flwr"), *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def online_nodes(self) -> int:
        """SuperNodes the SuperLink's control API lists as ``online`` (0 if it cannot say)."""
        try:
            out = self.flwr("supernode", "list", "loopback", "--format", "json").stdout
        except subprocess.TimeoutExpired:
            return 0
        return sum(1 for d in _records(_json(out)) if d.get("status") == "online")

    def finished(self, run_id: int) -> bool:
        """Whether the SuperLink lists run ``run_id`` as ``finished:...`` (False if unsure)."""
        try:
            runs = self.runs()
        except subprocess.TimeoutExpired:
            return False
        return any(str(r.get("run-id")) == str(run_id)
                   and str(r.get("status")).startswith("finished") for r in runs)

    def runs(self) -> list[dict[str, Any]]:
        """The runs the SuperLink knows (``flwr ls``)."""
        out = self.flwr("ls", "loopback", "--format", "json").stdout
        return [d for d in _records(_json(out)) if "run-id" in d]


class LogEcho:
    """Echo a run's streamed log to stdout, across reattached streams, printing each part once.

    The first stream is ``flwr run --stream`` (its own lines, ``Successfully started run N``,
    then the run's log); a reattached ``flwr log N --stream`` prints the run's log again from
    its start, so only what goes beyond the text already printed is echoed.
    """

    STARTED = b"Successfully started run "
    MARK = b"Starting logstream for run_id"

    def __init__(self) -> None:
        self.run_id: int | None = None
        self.printed = b""  # the run's log (after the stream's MARK line) echoed so far
        self._streams, self._head_len, self._head_done = 0, 0, False

    def follow(self, path: Path, proc: subprocess.Popen[bytes], start: float,
               timeout: float) -> None:
        """Echo ``path`` (the output of ``proc``) until ``proc`` exits; DeployError once
        ``timeout`` seconds have passed since ``start`` (``time.monotonic()``)."""
        first, self._streams = self._streams == 0, self._streams + 1
        text = b""
        with open(path, "rb") as out:
            while True:
                chunk = out.read()
                if chunk:
                    text += chunk
                    self._echo(text, first)
                elif proc.poll() is not None:
                    break
                elif time.monotonic() - start > timeout:
                    raise DeployError(f"flwr run: not finished within {timeout:g} s")
                else:
                    time.sleep(0.5)

    def _echo(self, text: bytes, first: bool) -> None:
        if self.run_id is None and self.STARTED in text:
            tail = text.split(self.STARTED, 1)[1].split(b"\n", 1)
            if len(tail) == 2 and tail[0].strip().isdigit():
                self.run_id = int(tail[0].strip())
        at = text.find(self.MARK)
        end = text.find(b"\n", at) if at >= 0 else -1
        if first and not self._head_done:  # flwr run's own lines, up to the MARK line
            head = text if end < 0 else text[:end + 1]
            self._write(head[self._head_len:])
            self._head_len, self._head_done = len(head), end >= 0
        if end < 0:
            return
        body = text[end + 1:]
        if body.startswith(self.printed):
            self._write(body[len(self.printed):])
            self.printed = body
        elif not self.printed.startswith(body):  # not the same log: show it whole
            self._write(body)
            self.printed = body

    @staticmethod
    def _write(data: bytes) -> None:
        if data:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()


def leftovers(home: Path) -> list[int]:
    """Live processes whose environment has ``FLWR_HOME=home`` (Linux /proc; else none)."""
    mark = f"FLWR_HOME={home}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mark not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def _log_hint(log: Path | None) -> str:
    if log is None:
        return ""
    tail = _tail(log)
    return f" (log: {log})" + (f"\n--- last lines of {log.name} ---\n{tail}" if tail else "")


def _json(text: str) -> Any:
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


def _records(obj: Any) -> list[dict[str, Any]]:
    """Every dict inside a JSON value that has a ``status`` (nodes or runs)."""
    if isinstance(obj, dict):
        own = [obj] if "status" in obj else []
        return own + [d for v in obj.values() for d in _records(v)]
    if isinstance(obj, list):
        return [d for v in obj for d in _records(v)]
    return []


def write_config(home: Path, port: int) -> None:
    """``FLWR_HOME/config.toml`` with the ``loopback`` SuperLink connection (the default)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
        f'address = "{HOST}:{port}"\ninsecure = true\n')


def deploy(*, supernodes: int, port: int, node_ports: Sequence[int], home: Path, app: Path,
           run_config: str, wait: float, run_timeout: float) -> int:
    """Start, run, stop; returns the exit status (0: the run finished:completed)."""
    for p in (port, *node_ports):
        _check_free(p, "SuperLink" if p == port else "SuperNode")
    write_config(home, port)
    with Deployment(home, wait=wait) as dep:
        t0 = time.monotonic()
        link = dep.start("superlink", [
            _executable("flower-superlink"), "--insecure", "--host", HOST, "--port", str(port),
            "--disable-runtime-dependency-installation"])  # state in memory: see below
        dep.wait_until(f"SuperLink on {HOST}:{port}", lambda: accepts(port), link,
                       dep.procs[-1][2])
        print(f"SuperLink accepts connections on {HOST}:{port} after "
              f"{time.monotonic() - t0:.1f} s", flush=True)
        for i, p in enumerate(node_ports):
            dep.start(f"supernode-{i}", [
                _executable("flower-supernode"), "--insecure", "--superlink", f"{HOST}:{port}",
                "--host", HOST, "--port", str(p),
                "--node-config", f"partition-id={i} num-partitions={supernodes}"])
        for i, p in enumerate(node_ports):
            _, proc, log = dep.procs[1 + i]
            dep.wait_until(f"SuperNode {i} on {HOST}:{p}", lambda p=p: accepts(p), proc, log)
        dep.wait_until(f"{supernodes} SuperNodes online at the SuperLink",
                       lambda: dep.online_nodes() >= supernodes, None, dep.procs[1][2])
        print(f"{supernodes} SuperNodes online after {time.monotonic() - t0:.1f} s", flush=True)
        argv = [_executable("flwr"), "run", str(app), "loopback", "--stream"]
        if run_config:
            argv += ["--run-config", run_config]
        t_run = time.monotonic()
        run = dep.start("flwr-run", argv)
        echo = LogEcho()
        echo.follow(dep.procs[-1][2], run, t_run, run_timeout)
        attempt = 0
        while run.returncode == 0 and echo.run_id is not None \
                and not dep.finished(echo.run_id):
            # Flower's log stream ends by itself when the run is quiet for a while (its
            # HTTP read times out, e.g. while 20 ClientApps start on two cores): reattach
            # with `flwr log` and echo only what is new.
            attempt += 1
            again = dep.start(f"flwr-log-{attempt}", [
                _executable("flwr"), "log", str(echo.run_id), "loopback", "--stream"])
            echo.follow(dep.procs[-1][2], again, t_run, run_timeout)
            time.sleep(1.0)
        status = ""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # the stream may end just before the status
            runs = dep.runs()
            status = ", ".join(str(r.get("status")) for r in runs)
            if runs and all(str(r.get("status")).startswith("finished") for r in runs):
                break
            time.sleep(1.0)
        print(f"flwr run exited with status {run.returncode} after "
              f"{time.monotonic() - t_run:.1f} s; run status: {status or 'unknown'}",
              flush=True)
        if run.returncode != 0 or not status or any(
                s.strip() != "finished:completed" for s in status.split(",")):
            return 1
        return 0


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--supernodes", type=int, default=3, help="SuperNodes (clients); 3")
    parser.add_argument("--port", type=int, default=39191,
                        help="SuperLink port (SuperNode i uses PORT+3+i); 0: free ports")
    parser.add_argument("--home", type=Path, default=None,
                        help="FLWR_HOME for this deployment (config, database, logs); default "
                             "a new temporary directory, removed afterwards")
    parser.add_argument("--app", type=Path, default=APP, help="the Flower app directory")
    parser.add_argument("--run-config", default="",
                        help="flwr run --run-config overrides; num-clients defaults to "
                             "--supernodes")
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds each start-up step may take (default 120)")
    parser.add_argument("--run-timeout", type=float, default=1800.0,
                        help="seconds the run may take (default 1800)")
    args = parser.parse_args(argv)
    if args.supernodes < 1:
        parser.error("--supernodes must be >= 1")
    if not (args.app / "pyproject.toml").exists():
        parser.error(f"--app {args.app}: no pyproject.toml there")
    run_config = args.run_config
    if "num-clients" not in run_config:
        run_config = f"num-clients={args.supernodes} {run_config}".strip()
    if args.port == 0:
        port, nodes = free_port(), [free_port() for _ in range(args.supernodes)]
    else:
        port, nodes = args.port, [args.port + 3 + i for i in range(args.supernodes)]
    home = args.home.resolve() if args.home is not None else Path(
        tempfile.mkdtemp(prefix="flwr-loopback-"))
    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C always stops the deployment, also when the script was started with SIGINT
    # ignored (a background job of a non-interactive shell inherits SIG_IGN, and Python
    # then installs no KeyboardInterrupt handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 1
    try:
        status = deploy(supernodes=args.supernodes, port=port, node_ports=nodes, home=home,
                        app=args.app.resolve(), run_config=run_config, wait=args.wait,
                        run_timeout=args.run_timeout)
    except MissingTool as exc:
        print(f"deploy_loopback: {exc}", file=sys.stderr)
        status = 2
    except DeployError as exc:
        print(f"deploy_loopback: {exc}", file=sys.stderr)
        status = 3
    except KeyboardInterrupt:
        print("deploy_loopback: interrupted; stopped every process it started",
              file=sys.stderr)
        status = 130
    finally:
        if args.home is None and status == 0:
            shutil.rmtree(home, ignore_errors=True)
        elif status != 0:
            print(f"deploy_loopback: logs in {home / 'logs'}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
