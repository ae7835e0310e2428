"""Upcycled-FL's per-client mechanisms built from plain settings: output perturbation (a
clipped model plus Gaussian noise) or objective perturbation (a linear noise term).

One builder, used by the bundled trainer (``--privacy output|objective``) and by the Flower
mods (:mod:`privkit.flower`), so the mechanism a client applies is the one its server charges.
It enforces each sensitivity's conditions instead of taking them on trust (module
:mod:`privkit.mechanisms.gaussian` for the sensitivities, :mod:`privkit.mechanisms.objective`
for Theorem C.2).

Example:
    >>> m = perturbation_mechanism("output", 500, l2_clip_norm=10.0, stddev=2.0)
    >>> round(m.noise_multiplier, 6), m.sensitivity
    (0.2, 20.0)
"""

from __future__ import annotations

from typing import Any

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.mechanisms.gaussian import GaussianOutputPerturbation, Sensitivity, Solver
from privkit.mechanisms.objective import ObjectivePerturbation

__all__ = ["SENSITIVITIES", "PERTURBATIONS", "smallest_batch", "check_perturbation",
           "perturbation_mechanism"]

#: The sensitivities of output perturbation, by their settings' names.
SENSITIVITIES = {
    "replace-one": Sensitivity.CLIP_REPLACE_ONE,
    "paper": Sensitivity.PAPER,
    "strongly-convex": Sensitivity.STRONGLY_CONVEX,
}
#: The two mechanisms.
PERTURBATIONS = ("output", "objective")


def smallest_batch(size: int, batch_size: int) -> int:
    """The smallest minibatch a local SGD solver forms for a client of ``size`` records: each
    epoch's last minibatch holds ``size mod b`` rows when b does not divide it, and the
    gradient is the mean over the rows present, so a record there weighs 1/(size mod b).

    >>> smallest_batch(101, 32), smallest_batch(96, 32), smallest_batch(10, 32)
    (5, 32, 10)
    """
    b = min(int(batch_size), int(size))
    r = int(size) % b
    return r if r else b


def check_perturbation(kind: str, *, sensitivity: str = "replace-one",
                       lipschitz_model: float | None = None, momentum: float = 0.5,
                       glm: bool = True, allow_unproven: bool = False) -> None:
    """Refuse settings under which the mechanism's bound would not hold.

    Raises:
        InvalidParameterError: an unknown kind or sensitivity; ``strongly-convex`` without
            u1 (``lipschitz``), with momentum or a non-convex model; objective perturbation
            outside Thm C.2 without ``allow_unproven``.
    """
    if kind not in PERTURBATIONS:
        raise InvalidParameterError("privacy", kind, "output or objective")
    if kind == "output":
        if sensitivity not in SENSITIVITIES:
            raise InvalidParameterError("sensitivity", sensitivity,
                                        f"one of {', '.join(SENSITIVITIES)}")
        if sensitivity == "strongly-convex":
            if lipschitz_model is None:
                raise InvalidParameterError(
                    "lipschitz", None, "given (u1, the per-example gradient bound) for "
                    "strongly-convex sensitivity")
            if momentum != 0 or not glm:
                raise InvalidParameterError(
                    "sensitivity", sensitivity,
                    "used with a convex model (logreg) and momentum 0: its bound does not "
                    "hold for momentum SGD or non-convex models")
        return
    if not allow_unproven:
        why = ("the model is not a GLM" if not glm else
               "the local solver is minibatch SGD, not an exact minimiser")
        raise InvalidParameterError(
            "privacy", "objective",
            f"used only where Thm C.2 holds ({why}); pass --allow-unproven to run it with its "
            "epsilon marked NOT PROVEN")


def perturbation_mechanism(kind: str, client_size: int, *, l2_clip_norm: float = 10.0,
                           stddev: float = 1.0, sensitivity: str = "replace-one",
                           alpha: float = 20.0, proximal_mu: float = 0.1,
                           lipschitz: float = 1.0, smoothness: float = 0.25, rank: int = 2,
                           lipschitz_model: float | None = None, batch_size: int = 32,
                           momentum: float = 0.5, allow_unproven: bool = False,
                           glm: bool = True) -> Any:
    """The privkit mechanism of a client with ``client_size`` records (its |D_i| enters the
    paper's and the strongly convex sensitivity, and objective perturbation's epsilon).

    Args:
        kind: ``output`` (:class:`GaussianOutputPerturbation`, noise stddev ``stddev`` on the
            model clipped to ``l2_clip_norm``) or ``objective``
            (:class:`ObjectivePerturbation`, rate ``alpha``, Thm C.2 constants ``lipschitz``,
            ``smoothness``, ``rank``, local objective's ``proximal_mu``).
        sensitivity: output perturbation's ``replace-one`` (2 tau), ``paper`` (tau/|D_i|) or
            ``strongly-convex`` (needs ``lipschitz_model`` = u1, momentum 0, a GLM; the bound
            uses the smallest minibatch of ``batch_size``).
        allow_unproven, glm: objective perturbation outside Thm C.2, marked NOT PROVEN.
    """
    check_perturbation(kind, sensitivity=sensitivity, lipschitz_model=lipschitz_model,
                       momentum=momentum, glm=glm, allow_unproven=allow_unproven)
    n = _validate.positive_int("client_size", client_size)
    if kind == "output":
        mode = SENSITIVITIES[sensitivity]
        kw: dict[str, Any] = {"sensitivity_mode": mode}
        if mode is Sensitivity.PAPER:
            kw["dataset_size"] = n
        elif mode is Sensitivity.STRONGLY_CONVEX:
            kw.update(dataset_size=n, lipschitz=lipschitz_model, strong_convexity=proximal_mu,
                      solver=Solver.MINIBATCH_SGD, batch_size=smallest_batch(n, batch_size))
        return GaussianOutputPerturbation.from_stddev(l2_clip_norm, stddev, **kw)
    return ObjectivePerturbation(
        alpha=alpha, dataset_size=n, proximal_mu=proximal_mu, lipschitz=lipschitz,
        smoothness=smoothness, rank=rank, glm=glm, exact_solver=False,
        allow_unproven=allow_unproven)
