"""``import privkit`` stays light (what it imports, not how long: timings are in bench/), and
the deferred dp-accounting package completes itself for code that needs the rest of it."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("scipy.stats", "scipy.signal", "scipy.optimize", "scipy.special", "dp_accounting.pld",
         "dp_accounting.rdp", "dp_accounting.mechanism_calibration", "torch", "fl_examples")


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_import_privkit_loads_no_heavy_module() -> None:
    out = _run("import sys, privkit\n"
               f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))")
    assert out == "[]"


def test_the_cli_parser_loads_no_heavy_module() -> None:
    # (the trainers' command modules register their options: light by design, no torch)
    heavy = HEAVY[:-1]
    out = _run("import sys\nfrom privkit import cli\ncli._build_parser()\n"
               f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))")
    assert out == "[]"


def test_dp_accounting_completes_itself_after_privkit() -> None:
    out = _run("import privkit, dp_accounting\n"
               "from dp_accounting.pld import PLDAccountant\n"
               "a = PLDAccountant()\n"
               "a.compose(privkit.gaussian_steps_event(1.0, 10))\n"
               "print(dp_accounting.NeighboringRelation.REPLACE_ONE.name,\n"
               "      dp_accounting.GaussianDpEvent is privkit.GaussianDpEvent,\n"
               "      callable(dp_accounting.calibrate_dp_mechanism),\n"
               "      round(a.get_epsilon(1e-5), 4))")
    assert out == "REPLACE_ONE True True 17.8566"


def test_dp_accounting_imported_first_is_used_as_is() -> None:
    out = _run("import dp_accounting, privkit\n"
               "print(privkit.GaussianDpEvent is dp_accounting.GaussianDpEvent)")
    assert out == "True"
