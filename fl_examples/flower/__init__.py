"""privkit's algorithms and mechanisms on Flower (``pip install privkit[flower]``).

- :class:`UpcycledFedProx`, :class:`PrivkitFedProx`: strategies for Flower's message API
  (``flwr.serverapp.strategy``) with seed-tree client sampling, Upcycled-FL's server-side even
  step and a privkit ledger (:class:`PrivacySettings`).
- :class:`OutputPerturbationMod`, :class:`ObjectivePerturbationMod`, :class:`RecMod`: client
  mods applying the privkit mechanism the ledger charged (DP-REC: seed + indices, decoded by the
  strategy), with explicit generators; :class:`DpSgdMod`: record-level DP-SGD in the
  ClientApp's local training, released only when the ClientApp confirms it.
- :class:`ClientLevelDP`: client-level DP-FedAvg around any Flower strategy (Poisson client
  sampling, clipped updates, one Gaussian draw on the sum, amplification priced by privkit,
  a privkit ledger charged before each round, ``max_epsilon`` stop).
- :func:`make_client_app`, :func:`make_server_app`: the pieces of the example app in
  ``fl_examples/flower/app`` (``flwr run``) and of ``run_simulation``.

See ``docs/flower.md``.
"""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("fl_examples.flower needs Flower: pip install 'privkit[flower]'") from exc

from fl_examples.flower.central import ClientLevelDP
from fl_examples.flower.client import load_federated, local_update, make_client_app
from fl_examples.flower.mods import (
    DpSgdMod,
    ObjectivePerturbationMod,
    OutputPerturbationMod,
    RecMod,
)
from fl_examples.flower.privacy import PrivacySettings, ServerAccountant
from fl_examples.flower.server import central_evaluate_fn, initial_arrays, make_server_app
from fl_examples.flower.strategy import PrivkitFedProx, UpcycledFedProx

__all__ = [
    "ClientLevelDP",
    "DpSgdMod",
    "central_evaluate_fn",
    "UpcycledFedProx",
    "PrivkitFedProx",
    "PrivacySettings",
    "ServerAccountant",
    "OutputPerturbationMod",
    "ObjectivePerturbationMod",
    "RecMod",
    "make_client_app",
    "make_server_app",
    "initial_arrays",
    "load_federated",
    "local_update",
]
