"""Start-up cost: ``import privkit`` and ``privkit --help`` against a bare interpreter.

Each command runs in a fresh interpreter, alternating with the baselines, and the median of
the runs is reported; ``-X importtime`` gives privkit's own cumulative import time and its
five heaviest modules. Targets: ``import privkit`` <= 0.4 s and ``privkit --help`` <= 0.6 s
(wall time, this machine); ``import privkit`` is also shown as a ratio to ``import numpy``
(measured in the same run), which a busy machine slows alike. The mechanisms and the
calibrators are imported on first use. Run ``python bench/imports.py [--runs N]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def importtime() -> tuple[float, list[tuple[float, str]]]:
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import privkit"],
                         check=True, capture_output=True, text=True).stderr
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    total = next(t for t, name in reversed(rows) if name.strip() == "privkit")
    heavy = sorted(((t, n.strip()) for t, n in rows if n.strip() != "privkit"), reverse=True)
    return total, heavy[:5]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    a = p.parse_args()
    cli = shutil.which("privkit") or str(Path(sys.executable).with_name("privkit"))
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "import numpy": [sys.executable, "-c", "import numpy"],
        "import privkit": [sys.executable, "-c", "import privkit"],
        "privkit --help": [cli, "--help"],
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.runs):
        for name, cmd in cases.items():
            times[name].append(wall(cmd))
    med = {k: statistics.median(v) for k, v in times.items()}
    base, numpy = med["python -c pass"], med["import numpy"]
    print(f"start-up, median of {a.runs} fresh interpreters (wall time); load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, t in med.items():
        target = {"import privkit": 0.4, "privkit --help": 0.6}.get(name)
        verdict = "" if target is None else ("  OK" if t <= target else "  MISSED") + \
            f" (target <= {target} s)"
        print(f"  {name:<16} {t:6.3f} s   {t / base:5.2f}x a bare interpreter{verdict}")
    print(f"  import privkit / import numpy: {med['import privkit'] / numpy:.2f}x "
          f"(privkit's own share {med['import privkit'] - numpy:.3f} s)")
    total, heavy = importtime()
    print(f"\n-X importtime: privkit {total:.3f} s cumulative; heaviest modules:")
    for t, name in heavy:
        print(f"  {t:6.3f} s  {name}")


if __name__ == "__main__":
    main()
