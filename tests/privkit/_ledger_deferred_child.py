"""Child process for the deferred-durability crash test: charge with ``durable=False``, sync
every few charges and only then "publish" (print) what the charges paid for, until killed.

Usage: python _ledger_deferred_child.py LEDGER_PATH SEED MAX_CHARGES

Prints ``ready`` once the ledger is open; after every sync, ``published SEQ``: the highest seq
whose release may now leave the process (flushed at once). With ``PRIVKIT_LEDGER_KEY`` set the
ledger is keyed (the key comes from the environment).
"""

import sys

import numpy as np

import privkit
from privkit.events import GaussianDpEvent
from privkit.ledger import Ledger


def main() -> None:
    path, seed, most = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ledger = Ledger.open(path)
    privkit.epsilon(GaussianDpEvent(50.0), 1e-5)  # imports before "ready"
    rng = np.random.default_rng(seed)
    clients = [f"c{i}" for i in range(20)]
    print("ready", flush=True)
    charged = -1
    with ledger.deferred():
        for r in range(most):
            ids = rng.choice(clients, size=int(rng.integers(1, 21)), replace=False)
            charged = ledger.spend(list(ids), GaussianDpEvent(50.0), label="deferred",
                                   round=r).seq
            if rng.random() < 0.3:  # a publication point: sync, then publish
                assert ledger.sync().seq == charged
                print("published", charged, flush=True)
    print("published", charged, flush=True)  # the block's end synced
    print("done", flush=True)
    sys.stdin.read()  # wait to be killed


if __name__ == "__main__":
    main()
