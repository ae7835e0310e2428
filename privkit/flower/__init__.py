"""privkit on Flower: client-level DP around any strategy, and client mods (the ``flower`` extra).

- :class:`ClientLevelDP`: client-level DP-FedAvg around any Flower message-API strategy
  (Poisson client sampling, each update clipped, one Gaussian draw on the sum, amplification
  priced by privkit, a privkit ledger charged before each round, a ``max_epsilon`` stop).
- :class:`BandedClientLevelDP`: client-level DP without Poisson sampling around a strategy's
  own cohort selection (banded matrix factorization's correlated noise; the server drops a
  chosen node that took part in the last b - 1 rounds or too often, and reports how often).
- Client mods for any ClientApp and strategy: :class:`OutputPerturbationMod`,
  :class:`ObjectivePerturbationMod` (Upcycled-FL's mechanisms), :class:`RecMod` (DP-REC: the
  update as a seed plus indices), :class:`DpSgdMod` (record-level DP-SGD in the ClientApp's
  training, released only when the ClientApp confirms it: :func:`dpsgd_request`).
- :class:`ClientSideClippingMod`: the ClientApp's half of ``ClientLevelDP(...,
  clipping="client")`` (each client clips its own update; the server adds the noise).
- :class:`DistributedDP` and :class:`DistributedDpMod`: client-level DP without a trusted
  aggregator on Flower's SecAgg+ (legacy workflow): each client adds its own Skellam noise
  share, the server decodes the modular sum (:func:`secaggplus_workflow` configures SecAgg+ to
  carry privkit's integers exactly).
- :class:`PrivacySettings`: the per-client mechanism a strategy sends its clients.
- :mod:`privkit.flower.records`: models <-> Flower records, and the message keys.

The papers' strategies (Upcycled-FL, FedProx with a server ledger) and the example app live
in the examples (``fl_examples.flower``), on top of this package. See ``docs/flower.md``.
"""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("privkit.flower needs Flower: from a checkout of privkit, "
                      "pip install -e '.[flower]'") from exc

from privkit.flower.banded import BandedClientLevelDP
from privkit.flower.central import POPULATION, ClientLevelDP
from privkit.flower.distributed import (
    DistributedDP,
    DistributedDpMod,
    modular_sum_from_secaggplus,
    secaggplus_parameters,
    secaggplus_workflow,
)
from privkit.flower.mods import (
    ClientSideClippingMod,
    DpSgdMod,
    DpSgdRequest,
    ObjectivePerturbationMod,
    OutputPerturbationMod,
    RecMod,
    dpsgd_request,
)
from privkit.flower.settings import MissingSettingError, PrivacySettings

__all__ = [
    "ClientLevelDP",
    "BandedClientLevelDP",
    "DistributedDP",
    "DistributedDpMod",
    "secaggplus_workflow",
    "secaggplus_parameters",
    "modular_sum_from_secaggplus",
    "POPULATION",
    "ClientSideClippingMod",
    "DpSgdMod",
    "DpSgdRequest",
    "dpsgd_request",
    "OutputPerturbationMod",
    "ObjectivePerturbationMod",
    "RecMod",
    "PrivacySettings",
    "MissingSettingError",
]
