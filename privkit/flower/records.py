"""Parameter dicts <-> Flower records, and the keys privkit's Flower messages carry.

A model travels as one :class:`flwr.app.ArrayRecord` whose keys are the model's parameter
names (``weight``, ``bias``, ...) in the model's own order; values are float32 numpy arrays
without a client axis. Train messages carry one :class:`flwr.app.ConfigRecord` under
``"config"`` with the keys below; replies carry one :class:`flwr.app.MetricRecord` under
``"metrics"`` with at least ``"num-examples"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from privkit.errors import InvalidParameterError

__all__ = [
    "to_record",
    "from_record",
    "to_torch",
    "ARRAYS",
    "CONFIG",
    "METRICS",
    "NUM_EXAMPLES",
    "SERVER_ROUND",
    "PROXIMAL_MU",
]

# -- record names inside a message (Flower's FedAvg conventions)
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
#: Weight of a reply (Flower's ``weighted_by_key``): the client's training records.
NUM_EXAMPLES = "num-examples"
#: Flower's own keys, set by FedAvg / FedProx.
SERVER_ROUND = "server-round"
PROXIMAL_MU = "proximal-mu"

# -- local solver (sent by the strategy, read by the client)
LR = "lr"
BATCH_SIZE = "batch-size"
MOMENTUM = "momentum"

# -- seed tree and client selection
SEED = "privkit-seed"
DATA_ROUND = "privkit-data-round"
CLIENT = "privkit-client"
CLIENT_SIZE = "privkit-client-size"
LOCAL_EPOCHS = "privkit-local-epochs"
BATCH_ORDER = "privkit-batch-order"
SELECTED = "privkit-selected"
SELECTED_SIZES = "privkit-selected-sizes"
SELECTED_EPOCHS = "privkit-selected-epochs"
#: Round metric of a privkit strategy: how many clients' replies it aggregated.
CLIENTS = "privkit-clients"

# -- roster query (node -> client id and size)
QUERY = "privkit-query"
ROSTER = "roster"
PARTITION_ID = "partition-id"

# -- privacy
PRIVACY_PREFIX = "privkit-privacy-"
LINEAR_TERM = "privkit-linear-term"
LINEAR_TERM_USED = "privkit-linear-term-used"
NOISE_MULTIPLIER = "privkit-noise-multiplier"
STEP_EPSILON = "privkit-step-epsilon"
#: A DP-REC reply's single array: the ``privkit.rec/1`` message bytes (uint8).
REC_MESSAGE = "privkit-rec-message"
UPLINK_BITS = "privkit-uplink-bits"
#: ConfigRecord a DpSgdMod adds to a train message: DP-SGD's settings and the noise seed.
DPSGD = "privkit-dpsgd"
#: Reply metric of a ClientApp that trained with DP-SGD: the local steps it ran.
DPSGD_STEPS = "privkit-dpsgd-steps"


def to_record(params: Mapping[str, Any]) -> ArrayRecord:
    """An ArrayRecord of ``params`` (torch tensors or numpy arrays), keys and order kept."""
    out = {}
    for name, value in params.items():
        arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        out[name] = Array(np.ascontiguousarray(arr))
    return ArrayRecord(out)


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """``{name: numpy array}`` of a record, in its order; every array must be floating point."""
    if not isinstance(record, ArrayRecord) or len(record) == 0:
        raise InvalidParameterError("arrays", type(record).__name__, "a non-empty ArrayRecord")
    out = {}
    for name, arr in record.items():
        value = arr.numpy()
        if value.dtype.kind != "f":
            raise InvalidParameterError(f"arrays[{name!r}]", value.dtype, "floating point")
        out[name] = value
    return out


def to_torch(record: ArrayRecord, device: Any = "cpu") -> dict[str, Any]:
    """``{name: torch tensor}`` of a record on ``device`` (fresh, writable tensors)."""
    import torch

    return {k: torch.tensor(v, device=device) for k, v in from_record(record).items()}
