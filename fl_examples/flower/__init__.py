"""The papers' algorithms on Flower, and the example app (privkit's ``flower`` extra).

- :class:`UpcycledFedProx`, :class:`PrivkitFedProx`: strategies for Flower's message API
  (``flwr.serverapp.strategy``) with seed-tree client sampling, Upcycled-FL's server-side even
  step and a privkit ledger (:class:`ServerAccountant`, charging the clients' mechanism,
  :class:`privkit.flower.PrivacySettings`).
- :func:`make_client_app`, :func:`make_server_app`: the pieces of the example app in
  ``fl_examples/flower/app`` (``flwr run``) and of ``run_simulation``.

The library parts (client-level DP around any strategy, the client mods) are
:mod:`privkit.flower`. See ``docs/flower.md``.
"""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("fl_examples.flower needs Flower: from a checkout of privkit, "
                      "pip install -e '.[flower]'") from exc

from fl_examples.flower.client import load_federated, local_update, make_client_app
from fl_examples.flower.privacy import ServerAccountant
from fl_examples.flower.server import central_evaluate_fn, initial_arrays, make_server_app
from fl_examples.flower.strategy import PrivkitFedProx, UpcycledFedProx

__all__ = [
    "central_evaluate_fn",
    "UpcycledFedProx",
    "PrivkitFedProx",
    "ServerAccountant",
    "make_client_app",
    "make_server_app",
    "initial_arrays",
    "load_federated",
    "local_update",
]
