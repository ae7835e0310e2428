"""Record-level DP-SGD for any PyTorch ``nn.Module`` (needs the ``torch`` extra).

``import privkit`` does not import this package (or torch); ``import privkit.torch`` does.

- **Per-example gradients** (:mod:`privkit.torch.grads`): ghost clipping for ``Linear``,
  ``Conv1d/2d/3d``, ``Embedding``, ``LayerNorm``, ``GroupNorm``, ``RMSNorm`` and
  ``nn.MultiheadAttention`` (hence the Transformer layers), the ghost norm or the materialised
  per-example gradient per layer, whichever is cheaper, with ``torch.func`` for any other
  layer, or ``torch.func`` for the whole model
  (:class:`GradMethod`; recurrent layers get it under ``GHOST`` too); layers that mix the
  examples of a batch (BatchNorm in training mode, ...) are refused by name
  (:func:`check_module`), and so is, under ``GHOST``, a parameter used outside its own
  module (tied weights). An example whose gradient holds NaN or inf contributes zeros, or
  raises (``nonfinite=``, :class:`~privkit.mechanisms.NonFiniteUpdates`).
- **A plain training loop** (:func:`make_private`, :class:`DpSgd`): Poisson batches,
  per-example clipping, Gaussian noise on the model's device, the sum divided by the expected
  batch size, each step charged on an optional :class:`~privkit.ledger.Ledger` before its
  noise, and the run's epsilon.
- **K federated clients at once** (:class:`ClientsDpSgd`): parameters stacked on a client
  axis, each client with its own data size, Poisson rate, number of steps, ledger entry and
  random stream (:class:`ClientStreams`), in lockstep without a Python loop over clients.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> import privkit.torch as pt
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> s = pt.clipped_grad_sum(net, torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1]),
    ...                         l2_clip_norm=1.0)
    >>> s.norms.shape, sorted(s.grads) == sorted(n for n, _ in net.named_parameters())
    (torch.Size([5]), True)
"""

from privkit.torch.clients import (
    ClientBatch,
    ClientsDpSgd,
    ClippedSumFn,
    LocalSgd,
    sampling_rates,
    steps_for_epochs,
)
from privkit.torch.grads import (
    ClippedGradSum,
    GradMethod,
    check_module,
    clip_factors,
    clipped_grad_sum,
    cross_entropy_per_example,
    per_example_grads,
    per_example_norms,
)
from privkit.torch.private import DpSgd, PoissonBatchSampler, make_private, step_event
from privkit.torch.streams import ClientStreams

__all__ = [
    "ClientBatch",
    "ClientStreams",
    "ClientsDpSgd",
    "ClippedGradSum",
    "ClippedSumFn",
    "DpSgd",
    "GradMethod",
    "LocalSgd",
    "PoissonBatchSampler",
    "check_module",
    "clip_factors",
    "clipped_grad_sum",
    "cross_entropy_per_example",
    "make_private",
    "per_example_grads",
    "per_example_norms",
    "sampling_rates",
    "step_event",
    "steps_for_epochs",
]
