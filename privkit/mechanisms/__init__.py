"""Mechanisms: clipping, noise samplers and the privacy mechanisms built on them.

Every mechanism is a frozen, validated dataclass whose ``__call__`` takes its
randomness explicitly (``rng=``: a ``numpy.random.Generator``, a
``torch.Generator`` or a :class:`SecureRandom`) and whose ``event()`` is the
privacy event of one use, priced by :func:`privkit.epsilon` or by
dp-accounting's own accountants where dp-accounting knows the event.

* :class:`GaussianOutputPerturbation` - Upcycled-FL output perturbation (Gaussian).
* :class:`ObjectivePerturbation` - Upcycled-FL objective perturbation (Thm C.2).
* :class:`LaplaceGradientNoise` - MAPA / AUDP per-example-clipped gradient noise.
* :class:`ClientLevelGaussian` - DP-FedAvg's aggregate: clip each update, noise the sum once.
* :class:`AdaptiveClipping` - the quantile-tracking clip norm of Andrew et al. (2021).
* :class:`DistributedSkellam` - distributed DP with secure aggregation: no trusted aggregator.
"""

from privkit.mechanisms.aggregate import (
    TRUST_ASSUMPTION,
    AdaptiveClipping,
    ClientLevelGaussian,
    NonFiniteUpdates,
    floating_state,
    unamplified_event,
)
from privkit.mechanisms.bandmf import (
    BANDMF_TRUST_ASSUMPTION,
    BandedToeplitzStrategy,
    BandMF,
    BandMFState,
    TreeStrategy,
)
from privkit.mechanisms.clipping import clip_l2, clip_per_example, l2_norm, row_l2_norms
from privkit.mechanisms.distributed import (
    DISTRIBUTED_TRUST_ASSUMPTION,
    DistributedSkellam,
    secure_sum,
)
from privkit.mechanisms.gaussian import (
    GaussianOutputPerturbation,
    Sensitivity,
    Solver,
    trainable_parameters,
)
from privkit.mechanisms.laplace import LaplaceGradientNoise, NoiseShape
from privkit.mechanisms.objective import ObjectivePerturbation
from privkit.mechanisms.sampling import (
    SecureRandom,
    gaussian_noise,
    l2_laplace_noise,
    l2_laplace_variance,
    laplace_noise,
    num_coordinates,
    tree_map,
)

__all__ = [
    "AdaptiveClipping",
    "BANDMF_TRUST_ASSUMPTION",
    "BandMF",
    "BandMFState",
    "BandedToeplitzStrategy",
    "TreeStrategy",
    "ClientLevelGaussian",
    "TRUST_ASSUMPTION",
    "DistributedSkellam",
    "DISTRIBUTED_TRUST_ASSUMPTION",
    "secure_sum",
    "GaussianOutputPerturbation",
    "LaplaceGradientNoise",
    "NonFiniteUpdates",
    "NoiseShape",
    "ObjectivePerturbation",
    "SecureRandom",
    "Sensitivity",
    "Solver",
    "clip_l2",
    "clip_per_example",
    "floating_state",
    "gaussian_noise",
    "l2_laplace_noise",
    "l2_laplace_variance",
    "l2_norm",
    "row_l2_norms",
    "laplace_noise",
    "num_coordinates",
    "trainable_parameters",
    "tree_map",
    "unamplified_event",
]
