"""Child process for the ledger crash test: charge random clients until killed.

Usage: python _ledger_crash_child.py LEDGER_PATH SEED MAX_SPENDS

Prints ``ready`` once the ledger is open, then the receipt seq of every spend
(the "release" that depends on it), flushing each line.
"""

import sys

import numpy as np

import privkit
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger


def main() -> None:
    path, seed, max_spends = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ledger = Ledger.open(path)
    # Warm up: the accountant imports its numerical modules on first use; do that before
    # "ready" so that the kill window covers spends, not imports.
    privkit.epsilon(GaussianDpEvent(50.0), 1e-5)
    rng = np.random.default_rng(seed)
    clients = [f"c{i}" for i in range(20)]
    print("ready", flush=True)
    for r in range(max_spends):
        ids = rng.choice(clients, size=int(rng.integers(1, 21)), replace=False)
        receipt = ledger.spend(list(ids), GaussianDpEvent(50.0), label="crash", round=r)
        print(receipt.seq, flush=True)
    print("done", flush=True)
    sys.stdin.read()  # wait to be killed


if __name__ == "__main__":
    main()
