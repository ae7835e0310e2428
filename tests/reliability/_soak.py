"""Switch between the CI subset and the full soak sweep of the reliability suite.

``PRIVKIT_SOAK=1`` (what ``make soak`` sets) turns every module from its CI subset into the
full sweep: 10^4 accountant settings instead of 500, 20+ kill points instead of 3, more
audit seeds. The CI subset uses fixed seeds, so a failure there reproduces exactly.
"""

from __future__ import annotations

import os

SOAK = os.environ.get("PRIVKIT_SOAK", "") == "1"


def scaled(ci: int, soak: int) -> int:
    """``soak`` under ``PRIVKIT_SOAK=1``, else ``ci``."""
    return soak if SOAK else ci
