"""Every trainer's quick runs, private and not, done once per test process (a few seconds
each) for the report and trade-off tests.

While they run, every figure saved is recorded (:data:`FIGURES`): per file, each axes' limits,
scales, labels and the data of its lines, so that a test can check what was drawn without
reading pixels.
"""

from __future__ import annotations

import atexit
import functools
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Upcycled-FL's small private settings (digits, 30 clients, one local epoch).
UPCYCLED = dict(dataset="digits:3", local_epochs=1, batch_size=32, lr=0.05, device="cpu",
                fraction=0.5, stragglers=0.0, seed=2, mu=0.1, lam=0.04)
MAPA = dict(dataset="digits", edges=6, batch=16, updates=40, eval_every=10, seed=3)
SCFL = dict(dataset="digits:3", clients=6, num_coded_rows=40, rounds=6, eval_every=2,
            batch_sampling="bernoulli", gradient_clip=0.5)
DPREC = dict(clients=10, clients_per_round=3, rounds=2, bits=2, eval_every=1, lr=0.2,
             device="cpu")

#: run name -> does its report hold an epsilon (not only SCFL's MI-DP)
RUNS = {
    "upcycled-output": True, "upcycled-objective": True, "upcycled-client": True,
    "upcycled-record": True, "upcycled-none": False, "mapa-pure": True, "mapa-gaussian": True,
    "scfl-coded": False, "scfl-gradient": True, "scfl-regression": True, "dprec": True,
}


@dataclass(frozen=True)
class Axes:
    """What one saved axes showed."""

    xlim: tuple[float, float]
    ylim: tuple[float, float]
    xscale: str
    yscale: str
    xlabel: str
    ylabel: str
    lines: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]  # (x, y) of each line
    bars: int


#: saved file -> its axes (filled while the quick runs save their figures)
FIGURES: dict[str, list[Axes]] = {}


def _floats(values: Any) -> tuple[float, ...]:
    out = []
    for v in values:
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            out.append(math.nan)
    return tuple(out)


def _record(fig: Any, path: Any) -> None:
    if not isinstance(path, (str, Path)):
        return
    FIGURES[str(Path(path).resolve())] = [
        Axes(tuple(ax.get_xlim()), tuple(ax.get_ylim()), ax.get_xscale(), ax.get_yscale(),
             ax.get_xlabel(), ax.get_ylabel(),
             tuple((_floats(line.get_xdata()), _floats(line.get_ydata()))
                   for line in ax.get_lines()),
             len(ax.patches))
        for ax in fig.get_axes()]


@functools.lru_cache(maxsize=1)
def quick_runs() -> dict[str, Path]:
    """name -> run directory of every quick run (:data:`RUNS`), in a temporary directory
    removed when the process ends."""
    from matplotlib.figure import Figure

    from fl_examples.dprec import DPRecConfig
    from fl_examples.dprec import train as dprec
    from fl_examples.mapa import MapaConfig
    from fl_examples.mapa import train as mapa
    from fl_examples.scfl import ScflConfig
    from fl_examples.scfl import train as scfl
    from fl_examples.upcycled import UpcycledConfig
    from fl_examples.upcycled import train as upcycled

    root = Path(tempfile.mkdtemp(prefix="quick-runs-"))
    atexit.register(shutil.rmtree, root, True)
    original = Figure.savefig

    def savefig(self: Any, fname: Any, *args: Any, **kwargs: Any) -> Any:
        _record(self, fname)
        return original(self, fname, *args, **kwargs)

    Figure.savefig = savefig  # type: ignore[method-assign]
    dirs = {name: root / name for name in RUNS}
    try:
        upcycled(UpcycledConfig(privacy="output", stddev=5.0, iterations=4, **UPCYCLED),
                 compare=("fedprox",), out=dirs["upcycled-output"])
        upcycled(UpcycledConfig(privacy="objective", alpha=50.0, allow_unproven=True,
                                iterations=2, **UPCYCLED), out=dirs["upcycled-objective"])
        upcycled(UpcycledConfig(privacy="client", client_rate=0.5, l2_clip_norm=1.0,
                                noise_multiplier=1.0, iterations=4, **UPCYCLED),
                 compare=("fedavg",), out=dirs["upcycled-client"])
        upcycled(UpcycledConfig(privacy="record", l2_clip_norm=1.0, noise_for_epsilon=8.0,
                                iterations=3, **UPCYCLED), out=dirs["upcycled-record"])
        upcycled(UpcycledConfig(iterations=4, **UPCYCLED), compare=("fedprox",),
                 out=dirs["upcycled-none"])
        mapa(MapaConfig(**MAPA, epsilon=2.0), out=dirs["mapa-pure"])
        mapa(MapaConfig(**MAPA, noise="gaussian", noise_for_epsilon=4.0),
             out=dirs["mapa-gaussian"])
        scfl(ScflConfig(**SCFL), algorithms="scfl,fl-pma", out=dirs["scfl-coded"])
        scfl(ScflConfig(**SCFL, gradient_noise_multiplier=1.2), algorithms="scfl,fl-pma,dp-cfl",
             out=dirs["scfl-gradient"])
        scfl(ScflConfig(**(SCFL | dict(dataset="linreg:4,2", clients=5)),
                        gradient_noise_multiplier=1.0), algorithms="scfl,fl-pma",
             out=dirs["scfl-regression"])
        dprec(DPRecConfig(**DPREC, stddev=0.7), compare=("dpfedavg", "fedavg"),
              out=dirs["dprec"])
    finally:
        Figure.savefig = original  # type: ignore[method-assign]
    return dirs
