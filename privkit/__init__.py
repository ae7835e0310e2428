"""privkit: differential privacy for federated learning.

The public API: accountants that price privacy events as (epsilon, delta)
upper bounds, calibration that never overshoots, privacy events that speak
dp-accounting's ``DpEvent`` algebra, and a per-client budget ledger.

Examples:
    >>> import privkit
    >>> ev = privkit.gaussian_steps_event(noise_multiplier=1.0, steps=100)
    >>> round(privkit.epsilon(ev, delta=1e-5).epsilon, 4)
    91.8173
"""

# First: registers dp-accounting without running its package __init__ (privkit._dpa).
from privkit import _dpa  # noqa: F401, I001
from privkit.accountants import (
    Accountant,
    EpsilonReport,
    Method,
    NeighboringRelation,
    delta,
    epsilon,
    epsilon_batch,
)
from privkit.errors import (
    BudgetExceededError,
    InvalidParameterError,
    NumericalError,
    PrivkitError,
    UnsupportedEventError,
)
from privkit.events import (
    ComposedDpEvent,
    DpEvent,
    GaussianDpEvent,
    L2LaplaceDpEvent,
    LaplaceDpEvent,
    ObjectivePerturbationDpEvent,
    PoissonSampledDpEvent,
    PureDpEvent,
    SelfComposedDpEvent,
    gaussian_steps_event,
    pure_steps_event,
)
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from privkit.accountants.calibration import (
        CalibrationResult,
        StepsResult,
        calibrate_noise,
        calibrate_noise_multiplier,
        calibrate_steps,
    )
    from privkit.mechanisms import (
        AdaptiveClipping,
        ClientLevelGaussian,
        GaussianOutputPerturbation,
        LaplaceGradientNoise,
        NoiseShape,
        ObjectivePerturbation,
        SecureRandom,
        Sensitivity,
        Solver,
    )

#: Names imported on first use (PEP 562), so that ``import privkit`` stays fast: the
#: mechanisms and the calibrators are not needed to price an event.
_LAZY = {
    **dict.fromkeys(("CalibrationResult", "StepsResult", "calibrate_noise",
                     "calibrate_noise_multiplier", "calibrate_steps"),
                    "privkit.accountants.calibration"),
    **dict.fromkeys(("AdaptiveClipping", "ClientLevelGaussian", "GaussianOutputPerturbation",
                     "LaplaceGradientNoise", "NoiseShape", "ObjectivePerturbation",
                     "SecureRandom", "Sensitivity", "Solver"), "privkit.mechanisms"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name == "mechanisms":
            import privkit.mechanisms

            return privkit.mechanisms
        raise AttributeError(f"module 'privkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "Accountant",
    "AdaptiveClipping",
    "ClientLevelGaussian",
    "BudgetExceededError",
    "ComposedDpEvent",
    "DpEvent",
    "GaussianDpEvent",
    "GaussianOutputPerturbation",
    "L2LaplaceDpEvent",
    "LaplaceGradientNoise",
    "NoiseShape",
    "ObjectivePerturbation",
    "ObjectivePerturbationDpEvent",
    "SecureRandom",
    "Sensitivity",
    "Solver",
    "LaplaceDpEvent",
    "PoissonSampledDpEvent",
    "SelfComposedDpEvent",
    "CalibrationResult",
    "EpsilonReport",
    "InvalidParameterError",
    "Method",
    "NeighboringRelation",
    "NumericalError",
    "PrivkitError",
    "PureDpEvent",
    "StepsResult",
    "UnsupportedEventError",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "delta",
    "epsilon",
    "epsilon_batch",
    "gaussian_steps_event",
    "pure_steps_event",
]
