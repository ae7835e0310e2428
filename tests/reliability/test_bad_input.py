"""Bad input, table-driven: API, CLI and data files.

Every row is a bad input and the word its error must name. API rows must raise a
``PrivkitError`` (a ``ValueError``) whose message contains that word. CLI rows run
``privkit.cli.main`` and must exit with status 2 after printing exactly one line (naming the
problem) on stderr and nothing on stdout. Every row runs beside a ledger that holds one
charge, and a trainer output directory: after the row, the ledger file's bytes are unchanged
(nothing charged) and no file in the sandbox was added or changed (nothing written half-way).
"""

from __future__ import annotations

import gzip
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import privkit
from privkit.accountants.calibration import calibrate_noise_multiplier
from privkit.accountants.objective import objective_step_epsilon
from privkit.cli import main
from privkit.errors import PrivkitError
from privkit.events import (
    GaussianDpEvent,
    L2LaplaceDpEvent,
    LaplaceDpEvent,
    PoissonSampledDpEvent,
    PureDpEvent,
    SelfComposedDpEvent,
    gaussian_steps_event,
)
from privkit.ledger import Ledger
from privkit.mechanisms.clipping import clip_l2, clip_per_example
from privkit.mechanisms.sampling import SecureRandom, gaussian_noise, l2_laplace_noise

NAN, INF = math.nan, math.inf
G = GaussianDpEvent(1.0)


@dataclass(frozen=True)
class Bad:
    id: str
    call: Callable[[Path, Ledger], Any]  # (sandbox, ledger) -> anything; must raise
    names: str  # the error message must contain this
    cli: bool = False  # call returns main()'s exit code instead of raising


def _cli(*argv: str) -> Callable[[Path, Ledger], Any]:
    def call(tmp: Path, led: Ledger) -> Any:
        try:
            return main([a.replace("{tmp}", str(tmp)) for a in argv])
        except SystemExit as exc:  # argparse's own errors (e.g. not a number)
            return exc.code

    return call


def _train(*argv: str) -> Callable[[Path, Ledger], Any]:
    base = ("train", "upcycled", "--dataset", "digits:3", "--rounds", "2", "--epochs", "1",
            "--device", "cpu", "--out", "{tmp}/run")
    return _cli(*base, *argv)


def _mech(**kw: Any) -> Any:
    return privkit.GaussianOutputPerturbation(**({"l2_clip_norm": 1.0, "stddev": 2.0} | kw))


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _dataset(**over: Any) -> Any:
    from fl_examples.core.data import FederatedDataset

    kw = dict(client_ids=("a", "b"), x_train=[np.zeros((3, 2)), np.ones((2, 2))],
              y_train=[np.array([0, 1, 1]), np.array([1, 0])],
              x_test=[np.zeros((1, 2)), np.zeros((0, 2))], y_test=[np.array([0]), []],
              num_features=2, num_classes=2)
    return FederatedDataset(**(kw | over))


# ------------------------------------------------------------------ data files
def _leaf(tmp: Path, body: Any, raw: str | None = None) -> Path:
    d = tmp / "leafdata"
    d.mkdir(exist_ok=True)
    (d / "data.json").write_text(raw if raw is not None else json.dumps(body))
    return d


_GOOD_USER = {"x": [[0.0, 1.0], [1.0, 0.0]], "y": [0, 1]}


def _leaf_body(**over: Any) -> dict[str, Any]:
    body = {"users": ["u"], "num_samples": [2], "user_data": {"u": dict(_GOOD_USER)}}
    return body | over


def _load_leaf(tmp: Path, body: Any = None, raw: str | None = None) -> Any:
    from fl_examples.core.data import parse_dataset_spec

    return parse_dataset_spec(f"leaf:{_leaf(tmp, body, raw)}", seed=0)


def _idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    head = struct.pack(">HBB", 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.astype(">u1").tobytes()


def _mnist(tmp: Path, images: bytes, labels: bytes, gz: bool = False) -> Any:
    from fl_examples.core.data import parse_dataset_spec

    d = tmp / "mnistdata"
    d.mkdir(exist_ok=True)
    suffix = ".gz" if gz else ""
    for name, data in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels)):
        (d / (name + suffix)).write_bytes(gzip.compress(data) if gz else data)
    return parse_dataset_spec(f"mnist:{d}", seed=0)


_IMG = np.zeros((4, 28, 28), dtype=np.uint8)
_LAB = np.array([0, 1, 2, 3], dtype=np.uint8)


_ZERO_USERS = {"users": [], "num_samples": [], "user_data": {}}

#: A short, valid run of each trainer (without --out).
_TRAINERS = {
    "upcycled": ("--dataset", "digits:3", "--rounds", "2", "--epochs", "1", "--device", "cpu"),
    "mapa": ("--algorithms", "audp", "--clients", "4", "--rounds", "10", "--eval-every", "5"),
    "scfl": ("--clients", "4", "--coded-rows", "20", "--rounds", "2", "--algorithms", "scfl"),
    "dprec": ("--clients", "10", "--clients-per-round", "4", "--rounds", "2", "--bits", "4",
              "--algorithms", "dprec", "--device", "cpu"),
}


def _read_only(root: Path, call: Callable[[Path, Ledger], Any], tmp: Path, led: Ledger) -> Any:
    """``call`` while every directory at or under ``root`` refuses writes as a read-only file
    system does (root may write anywhere, so the refusal is simulated at the system calls)."""
    import errno
    import os
    import tempfile
    from unittest import mock

    def refuse(path: Any) -> None:
        p = Path(os.fspath(path)).absolute()
        if p == root.absolute() or root.absolute() in p.parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))

    real_mkstemp, real_mkdir = tempfile.mkstemp, Path.mkdir

    def mkstemp(*a: Any, dir: Any = None, **kw: Any) -> Any:  # noqa: A002 - tempfile's name
        refuse(Path(dir) / "x" if dir is not None else Path.cwd())
        return real_mkstemp(*a, dir=dir, **kw)

    def mkdir(self: Path, *a: Any, **kw: Any) -> None:
        refuse(self)
        return real_mkdir(self, *a, **kw)

    with mock.patch.object(tempfile, "mkstemp", mkstemp), mock.patch.object(Path, "mkdir", mkdir):
        return call(tmp, led)


def _with_env(env: dict[str, str], call: Callable[..., Any], *args: Any) -> Any:
    from unittest import mock

    with mock.patch.dict("os.environ", env):
        return call(*args)


def _code(features: Any) -> Any:
    from privkit.mechanisms.coded import code_client_data

    return code_client_data(features, num_coded_rows=4, stddev=1.0, row_l2_bound=1.0,
                            rng=_rng())


def _train_mnist(tmp: Path, led: Ledger) -> Any:
    d = tmp / "mnistdata"
    d.mkdir(exist_ok=True)
    (d / "train-images-idx3-ubyte").write_bytes(_idx_bytes(_IMG[:0]))
    (d / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(_LAB[:0]))
    return main(["train", "upcycled", "--dataset", f"mnist:{d}", "--rounds", "2",
                 "--out", str(tmp / "run")])


# ------------------------------------------------------------------------ rows
ROWS: list[Bad] = [
    # accountants
    Bad("delta-0", lambda t, led: privkit.epsilon(G, 0.0), "delta"),
    Bad("delta-1", lambda t, led: privkit.epsilon(G, 1.0), "delta"),
    Bad("delta-nan", lambda t, led: privkit.epsilon(G, NAN), "delta"),
    Bad("delta-negative", lambda t, led: privkit.epsilon(G, -1e-5), "delta"),
    Bad("delta-inf", lambda t, led: privkit.epsilon(G, INF), "delta"),
    Bad("delta-string", lambda t, led: privkit.epsilon(G, "1e-5"), "delta"),
    Bad("z-nan", lambda t, led: privkit.epsilon(GaussianDpEvent(NAN), 1e-5), "noise_multiplier"),
    Bad("z-negative", lambda t, led: privkit.epsilon(GaussianDpEvent(-1.0), 1e-5),
        "noise_multiplier"),
    Bad("z-inf", lambda t, led: privkit.epsilon(GaussianDpEvent(INF), 1e-5), "noise_multiplier"),
    Bad("laplace-nan", lambda t, led: privkit.epsilon(LaplaceDpEvent(NAN), 1e-5),
        "noise_multiplier"),
    Bad("q-0", lambda t, led: privkit.epsilon(PoissonSampledDpEvent(0.0, G), 1e-5),
        "sampling_probability"),
    Bad("q-1.5", lambda t, led: privkit.epsilon(PoissonSampledDpEvent(1.5, G), 1e-5),
        "sampling_probability"),
    Bad("q-nan", lambda t, led: privkit.epsilon(PoissonSampledDpEvent(NAN, G), 1e-5),
        "sampling_probability"),
    Bad("count-negative", lambda t, led: privkit.epsilon(SelfComposedDpEvent(G, -1), 1e-5),
        "count"),
    Bad("pure-eps-0", lambda t, led: PureDpEvent(0.0), "epsilon"),
    Bad("pure-eps-nan", lambda t, led: PureDpEvent(NAN), "epsilon"),
    Bad("l2laplace-dim-0", lambda t, led: L2LaplaceDpEvent(1.0, 0), "dimension"),
    Bad("delta-of-negative-eps", lambda t, led: privkit.delta(G, -1.0), "epsilon"),
    Bad("delta-of-nan-eps", lambda t, led: privkit.delta(G, NAN), "epsilon"),
    Bad("method-unknown", lambda t, led: privkit.epsilon(G, 1e-5, "gdp"), "method"),
    Bad("event-not-an-event", lambda t, led: privkit.epsilon("gaussian", 1e-5), "event"),
    Bad("steps-0", lambda t, led: gaussian_steps_event(1.0, 0), "steps"),
    Bad("steps-fractional", lambda t, led: gaussian_steps_event(1.0, 2.5), "steps"),
    Bad("calibrate-target-0", lambda t, led: calibrate_noise_multiplier(
        target_epsilon=0.0, delta=1e-5, steps=10), "target_epsilon"),
    Bad("calibrate-target-nan", lambda t, led: calibrate_noise_multiplier(
        target_epsilon=NAN, delta=1e-5, steps=10), "target_epsilon"),
    Bad("objective-alpha-negative", lambda t, led: objective_step_epsilon(
        alpha=-1.0, lipschitz=1.0, smoothness=0.25, rank=2, dataset_size=10, proximal_mu=0.1),
        "alpha"),
    Bad("objective-condition-d", lambda t, led: objective_step_epsilon(
        alpha=1.0, lipschitz=1.0, smoothness=5.0, rank=2, dataset_size=10, proximal_mu=0.1),
        "smoothness"),
    Bad("objective-single-sample-condition-d", lambda t, led: objective_step_epsilon(
        alpha=1.0, lipschitz=1.0, smoothness=0.25, rank=2, dataset_size=1, proximal_mu=0.1),
        "dataset_size=1"),
    # mechanisms
    Bad("clip-0", lambda t, led: _mech(l2_clip_norm=0.0), "l2_clip_norm"),
    Bad("mechanism-z-nan", lambda t, led: _mech(noise_multiplier=NAN), "noise_multiplier"),
    Bad("stddev-negative", lambda t, led: privkit.GaussianOutputPerturbation.from_stddev(
        1.0, -1.0), "stddev"),
    Bad("update-nan", lambda t, led: _mech()({"w": np.array([1.0, NAN])}, rng=_rng()), "'w'"),
    Bad("update-inf-torch", lambda t, led: _mech()({"b": torch.tensor([INF])}, rng=_rng()),
        "'b'"),
    Bad("update-empty-tree", lambda t, led: _mech()({}, rng=_rng()), "tree"),
    Bad("update-int-dtype", lambda t, led: _mech()({"w": np.arange(3)}, rng=_rng()),
        "floating-point"),
    Bad("rng-int-seed", lambda t, led: _mech()({"w": np.zeros(2)}, rng=0), "rng"),
    Bad("clip-nan-bound", lambda t, led: clip_l2(np.ones(3), NAN), "l2_clip_norm"),
    Bad("per-example-mismatched-batch", lambda t, led: clip_per_example(
        {"a": np.ones((3, 2)), "b": np.ones((4, 2))}, 1.0), "b"),
    Bad("gaussian-noise-stddev-0", lambda t, led: gaussian_noise(np.zeros(2), 0.0, rng=_rng()),
        "stddev"),
    Bad("l2-laplace-alpha-inf", lambda t, led: l2_laplace_noise(np.zeros(2), INF, rng=_rng()),
        "alpha"),
    Bad("secure-seeded", lambda t, led: SecureRandom(seed=7), "seed"),
    Bad("objective-mechanism-alpha-0", lambda t, led: privkit.ObjectivePerturbation(
        alpha=0.0, dataset_size=100, proximal_mu=1.0), "alpha"),
    # ledger (the sandbox ledger must stay byte-identical)
    Bad("spend-no-clients", lambda t, led: led.spend([], G, label="x"), "client_ids"),
    Bad("spend-duplicate-clients", lambda t, led: led.spend(["a", "a"], G, label="x"),
        "client_ids"),
    Bad("spend-nan-event", lambda t, led: led.spend(["a"], GaussianDpEvent(NAN), label="x"),
        "noise_multiplier"),
    Bad("spend-empty-label", lambda t, led: led.spend(["a"], G, label=""), "label"),
    Bad("spend-count-0", lambda t, led: led.spend(["a"], G, label="x", count=0), "count"),
    Bad("spend-meta-nan", lambda t, led: led.spend(["a"], G, label="x", meta={"v": NAN}), "meta"),
    Bad("ledger-delta-0", lambda t, led: Ledger.create(t / "new.jsonl", population_id="p",
                                                      delta=0.0), "delta"),
    Bad("ledger-budget-negative", lambda t, led: Ledger.create(
        t / "new.jsonl", population_id="p", delta=1e-5, epsilon_budget=-1.0), "epsilon_budget"),
    # data sets in memory
    Bad("dataset-no-clients", lambda t, led: _dataset(client_ids=(), x_train=[], y_train=[],
                                                    x_test=[], y_test=[]), "client_ids"),
    Bad("dataset-no-training-samples", lambda t, led: _dataset(
        x_train=[np.zeros((0, 2)), np.zeros((0, 2))], y_train=[[], []]), "x_train"),
    Bad("dataset-mismatched-shapes", lambda t, led: _dataset(
        y_train=[np.array([0, 1]), np.array([1, 0])]), "y_train[0]"),
    Bad("dataset-wrong-width", lambda t, led: _dataset(
        x_train=[np.zeros((3, 5)), np.ones((2, 2))]), "x_train[0]"),
    Bad("dataset-float-labels", lambda t, led: _dataset(
        y_train=[np.array([0.5, 1, 1]), np.array([1, 0])]), "y_train[0]"),
    Bad("dataset-nan-features", lambda t, led: _dataset(
        x_train=[np.full((3, 2), NAN), np.ones((2, 2))]), "x_train[0]"),
    Bad("dataset-label-out-of-range", lambda t, led: _dataset(
        y_train=[np.array([0, 1, 7]), np.array([1, 0])]), "y_train[0]"),
    # dataset specs
    Bad("spec-unknown", lambda t, led: _spec("imagenet"), "imagenet"),
    Bad("spec-synthetic-words", lambda t, led: _spec("synthetic:abc"), "synthetic"),
    Bad("spec-synthetic-nan", lambda t, led: _spec("synthetic:nan,1"), "nan"),
    Bad("spec-digits-0", lambda t, led: _spec("digits:0"), "digits"),
    Bad("spec-missing-dir", lambda t, led: _spec(f"mnist:{t}/missing"), "mnist"),
    # LEAF JSON files
    Bad("leaf-not-json", lambda t, led: _load_leaf(t, raw="{users: ["), "not valid JSON"),
    Bad("leaf-not-an-object", lambda t, led: _load_leaf(t, [1, 2]), "<root>"),
    Bad("leaf-missing-users", lambda t, led: _load_leaf(t, {"num_samples": [2], "user_data": {}}),
        "users"),
    Bad("leaf-count-mismatch", lambda t, led: _load_leaf(t, _leaf_body(num_samples=[5])),
        "num_samples"),
    Bad("leaf-duplicate-users", lambda t, led: _load_leaf(t, _leaf_body(
        users=["u", "u"], num_samples=[2, 2])), "users"),
    Bad("leaf-ragged-features", lambda t, led: _load_leaf(t, _leaf_body(
        user_data={"u": {"x": [[0.0, 1.0], [1.0]], "y": [0, 1]}})), "x"),
    Bad("leaf-nan-features", lambda t, led: _load_leaf(t, raw=json.dumps(_leaf_body()).replace(
        "1.0]", "NaN]", 1)), "NaN"),
    Bad("leaf-empty-dir", lambda t, led: _spec(f"leaf:{_empty_dir(t)}"), "directory"),
    Bad("leaf-no-samples", lambda t, led: _load_leaf(t, _leaf_body(
        num_samples=[0], user_data={"u": {"x": [], "y": []}})), "no samples"),
    # IDX files
    Bad("idx-bad-magic", lambda t, led: _mnist(t, b"\x01\x02" + _idx_bytes(_IMG)[2:],
                                             _idx_bytes(_LAB)), "magic"),
    Bad("idx-truncated", lambda t, led: _mnist(t, _idx_bytes(_IMG)[:-10], _idx_bytes(_LAB)),
        "data"),
    Bad("idx-unknown-type", lambda t, led: _mnist(t, _idx_bytes(_IMG)[:2] + b"\x07"
                                                + _idx_bytes(_IMG)[3:], _idx_bytes(_LAB)),
        "type byte"),
    Bad("idx-count-mismatch", lambda t, led: _mnist(t, _idx_bytes(_IMG), _idx_bytes(_LAB[:3])),
        "labels"),
    Bad("idx-label-not-a-digit", lambda t, led: _mnist(t, _idx_bytes(_IMG), _idx_bytes(
        np.array([0, 1, 2, 11], dtype=np.uint8))), "digit"),
    Bad("idx-bad-gzip", lambda t, led: _mnist_gz_garbage(t), "gzip"),
    # CLI: one line, exit 2
    Bad("cli-z-nan", _cli("epsilon", "gaussian", "--noise-multiplier", "nan", "--steps", "10",
                          "--delta", "1e-5"), "--noise-multiplier", cli=True),
    Bad("cli-delta-1", _cli("epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "10",
                            "--delta", "1"), "delta", cli=True),
    Bad("cli-steps-negative", _cli("epsilon", "gaussian", "--noise-multiplier", "1", "--steps",
                                   "-3", "--delta", "1e-5"), "steps", cli=True),
    Bad("cli-q-2", _cli("epsilon", "gaussian", "--noise-multiplier", "1", "--steps", "10",
                        "--delta", "1e-5", "--sampling-probability", "2"),
        "--sampling-probability", cli=True),
    Bad("cli-pure-eps-0", _cli("epsilon", "pure", "--epsilon", "0", "--steps", "10", "--delta",
                               "1e-5"), "epsilon", cli=True),
    Bad("cli-calibrate-target-negative", _cli("calibrate", "gaussian", "--target-epsilon", "-1",
                                              "--delta", "1e-5", "--steps", "10"),
        "--target-epsilon", cli=True),
    Bad("cli-not-a-number", _cli("epsilon", "gaussian", "--noise-multiplier", "one", "--steps",
                                 "10", "--delta", "1e-5"), "noise-multiplier", cli=True),
    Bad("cli-audit-trials-negative", _cli("audit", "gaussian", "--trials", "-5"), "trials",
        cli=True),
    Bad("train-unknown-dataset", _train("--dataset", "imagenet"), "imagenet", cli=True),
    Bad("train-sigma-0", _train("--privacy", "output", "--sigma", "0"), "--sigma", cli=True),
    Bad("train-delta-0", _train("--privacy", "output", "--delta", "0"), "delta", cli=True),
    Bad("train-budget-nan", _train("--privacy", "output", "--epsilon-budget", "nan"),
        "--epsilon-budget", cli=True),
    Bad("train-fraction-0", _train("--fraction", "0"), "fraction", cli=True),
    Bad("train-malformed-leaf", lambda t, led: main([
        "train", "upcycled", "--dataset", f"leaf:{_leaf(t, _leaf_body(num_samples=[5]))}",
        "--out", str(t / "run")]), "num_samples", cli=True),
    Bad("train-private-without-heldout", lambda t, led: main([
        "train", "upcycled", "--dataset", f"leaf:{_leaf(t, _leaf_body())}", "--privacy",
        "output", "--out", str(t / "run")]), "--eval-client-data", cli=True),
    Bad("train-flag-that-does-not-apply", _train("--privacy", "record", "--sigma", "2"),
        "--sigma", cli=True),
    Bad("cli-pld-extreme-noise", _cli("epsilon", "gaussian", "--noise-multiplier", "1e-200",
                                      "--steps", "1", "--delta", "1e-5", "--method", "pld"),
        "pld cannot price", cli=True),
    # output paths: checked before anything is read or charged, one line naming the path
    *[Bad(f"out-{what}-{cmd}", _cli("train", cmd, *args, "--out", out), name, cli=True)
      for cmd, args in _TRAINERS.items()
      for what, out, name in (("a-file", "{tmp}/ledger.jsonl", "it is a file"),
                              ("under-a-file", "{tmp}/ledger.jsonl/run", "Not a directory"),
                              ("in-proc", "/proc/x", "'/proc/x'"))],
    Bad("out-read-only-fs", lambda t, led: _read_only(t / "ro", _train("--out", "{tmp}/ro/run"),
                                                      t, led), "Read-only file system", cli=True),
    Bad("out-read-only-on-resume", lambda t, led: _read_only(
        t, _train("--out", "{tmp}", "--resume"), t, led), "Read-only file system", cli=True),
    Bad("out-empty-string", _train("--out", ""), "--out must be a directory path", cli=True),
    Bad("report-out-in-proc", _cli("report", "tradeoff", "{tmp}", "--out", "/proc/x/t.png"),
        "'/proc/x/t.png'", cli=True),
    Bad("report-out-under-a-file", _cli("report", "tradeoff", "{tmp}", "--out",
                                        "{tmp}/ledger.jsonl/t.png"), "ledger.jsonl/t.png",
        cli=True),
    # reruns: a new run needs a new or empty OUT; --resume needs a run
    Bad("rerun-without-resume", _train("--privacy", "output", "--out", "{tmp}"),
        "pass --resume", cli=True),
    Bad("rerun-mapa-without-resume", _cli("train", "mapa", *_TRAINERS["mapa"], "--out", "{tmp}"),
        "pass --resume", cli=True),
    Bad("resume-empty-out", _train("--resume", "--out", "{tmp}/nothing"),
        "holding a run to resume (it is missing)", cli=True),
    Bad("resume-and-overwrite", _train("--resume", "--overwrite", "--out", "{tmp}"),
        "--overwrite", cli=True),
    Bad("max-loss-factor-below-1", _train("--max-loss-factor", "0.5"), "--max-loss-factor",
        cli=True),
    # data edge cases
    Bad("leaf-zero-users", lambda t, led: _load_leaf(t, _ZERO_USERS), "lists no user"),
    Bad("leaf-deep-nesting", lambda t, led: _load_leaf(t, raw="[" * 100_000 + "]" * 100_000),
        "nested too deeply"),
    Bad("train-leaf-zero-users", lambda t, led: main([
        "train", "upcycled", "--dataset", f"leaf:{_leaf(t, _ZERO_USERS)}", "--out",
        str(t / "run")]), "lists no user", cli=True),
    Bad("idx-zero-images", lambda t, led: _mnist(t, _idx_bytes(_IMG[:0]), _idx_bytes(_LAB[:0])),
        "holds no image"),
    Bad("train-idx-zero-images", lambda t, led: _train_mnist(t, led), "holds no image",
        cli=True),
    Bad("dprec-more-clients-per-round-than-clients", _cli(
        "train", "dprec", *_TRAINERS["dprec"], "--clients", "10", "--clients-per-round", "100",
        "--out", "{tmp}/run"), "--clients-per-round must be at most the number of clients (10)",
        cli=True),
    # mechanisms: no coordinates, integer data, the argument's own name
    Bad("clip-l2-empty-array", lambda t, led: clip_l2(np.zeros(0), 1.0), "coordinate"),
    Bad("coded-zero-rows", lambda t, led: _code(np.zeros((0, 3))), "features.shape"),
    Bad("coded-integer-features", lambda t, led: _code(np.arange(6).reshape(3, 2)),
        "features.dtype"),
    Bad("laplace-names-per-example-grads", lambda t, led: privkit.LaplaceGradientNoise(
        1.0, 2, 1.0)(np.array([[1.0, NAN], [1.0, 1.0]]), rng=_rng()), "per_example_grads[0]"),
    Bad("secure-keyed", lambda t, led: SecureRandom(key=1), "key must be None"),
    Bad("train-sigma-names-the-flag", _train("--privacy", "output", "--sigma", "-1"),
        "--sigma must be", cli=True),
    Bad("scfl-noise-stddev-names-the-flag", _cli(
        "train", "scfl", *_TRAINERS["scfl"], "--noise-stddev", "nan", "--out", "{tmp}/run"),
        "--noise-stddev must be", cli=True),
    # ledgers: a missing journal, a bad key
    Bad("ledger-open-missing", lambda t, led: Ledger.open(t / "missing.jsonl"), "no ledger at"),
    Bad("cli-ledger-verify-missing", _cli("ledger", "verify", "{tmp}/missing.jsonl"),
        "no ledger at", cli=True),
    Bad("cli-ledger-recover-without-accept", _cli("ledger", "recover", "{tmp}/ledger.jsonl"),
        "--accept-rollback", cli=True),
    Bad("cli-ledger-recover-nothing", _cli("ledger", "recover", "{tmp}/ledger.jsonl",
                                           "--accept-rollback"), "nothing to recover",
        cli=True),
    Bad("ledger-key-file-missing", lambda t, led: _with_env(
        {"PRIVKIT_LEDGER_KEY_FILE": str(t / "no-key")}, lambda: Ledger.open(t / "ledger.jsonl")),
        "PRIVKIT_LEDGER_KEY_FILE"),
    Bad("ledger-key-too-short", lambda t, led: _with_env(
        {"PRIVKIT_LEDGER_KEY": "short"}, _train("--privacy", "output"), t, led),
        "PRIVKIT_LEDGER_KEY must be at least 16 bytes", cli=True),
]


def _spec(spec: str) -> Any:
    from fl_examples.core.data import parse_dataset_spec

    return parse_dataset_spec(spec, seed=0)


def _empty_dir(tmp: Path) -> Path:
    d = tmp / "emptydir"
    d.mkdir(exist_ok=True)
    return d


def _mnist_gz_garbage(tmp: Path) -> Any:
    from fl_examples.core.data import parse_dataset_spec

    d = tmp / "gzdata"
    d.mkdir(exist_ok=True)
    (d / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    (d / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(_LAB)))
    return parse_dataset_spec(f"mnist:{d}", seed=0)


INPUTS = ("leafdata", "mnistdata", "gzdata", "emptydir")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_table_is_large_enough():
    assert len(ROWS) >= 50
    assert len({r.id for r in ROWS}) == len(ROWS)
    assert sum(r.cli for r in ROWS) >= 10


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_bad_input_is_refused_cleanly(row, tmp_path, capsys):
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    led = Ledger.create(sandbox / "ledger.jsonl", population_id="p", delta=1e-5,
                        epsilon_budget=10.0)
    led.spend(["a", "b"], GaussianDpEvent(5.0), label="before")
    before = _files(sandbox)
    capsys.readouterr()
    if row.cli:
        code = row.call(sandbox, led)
        out, err = capsys.readouterr()
        assert code == 2, (code, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and row.names in lines[0], err
        assert out == ""
    else:
        with pytest.raises(PrivkitError) as info:
            row.call(sandbox, led)
        assert row.names in str(info.value), str(info.value)
        assert isinstance(info.value, ValueError)
    after = _files(sandbox)
    inputs = {k for k in after if k.startswith(INPUTS)}
    rest = {k: v for k, v in after.items() if k not in inputs}
    assert rest == before  # nothing written half-way (a trainer leaves not even an empty ledger)
    assert {p.relative_to(sandbox).parts[0] for p in sandbox.iterdir()} - set(INPUTS) \
        <= {"ledger.jsonl", "ledger.jsonl.head"}  # no output directory either
    assert Ledger.open(sandbox / "ledger.jsonl").epsilons() == led.epsilons()  # nothing charged
    assert led.head().seq == 1
