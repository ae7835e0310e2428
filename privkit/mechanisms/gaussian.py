"""Gaussian output perturbation (Upcycled-FL, Sec. 5 / Thm C.1) with sound sensitivity modes.

A client clips its locally trained model to the L2 ball of radius ``tau`` and
releases ``xi(w) + n`` with ``n ~ N(0, stddev^2 I)`` (Yin et al., arXiv
2310.06341, output perturbation on odd steps). One release is the Gaussian
mechanism of sensitivity ``Delta``; what ``Delta`` is depends on what is known about how
``w`` was produced (:class:`Sensitivity`, upcycled_fl.md 3.2):

* ``CLIP_REPLACE_ONE`` (default): ``Delta = 2 tau``. Always valid: two points
  of a tau-ball are at most 2 tau apart.
* ``PAPER``: ``Delta = tau / |D_i|``, the assumption behind Thm C.1 (the
  release is an average of per-example terms of norm <= tau, add-one
  neighbours). A model trained by SGD and then clipped is *not* such an
  average, so this mode only reproduces the paper's numbers.
* ``STRONGLY_CONVEX``: ``Delta = min(2 tau, bound)`` with the bound of the
  solver (:class:`Solver`) for per-example losses that are convex with gradient
  norm <= u1 and a rho-strongly convex local objective.
"""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.events import GaussianDpEvent, ReplaceOneGaussianDpEvent
from privkit.mechanisms._tree import (
    _add_noise,
    _check_enum,
    _check_noise_scale,
    _check_tree,
    _no_grad,
    _optional,
    _torch,
)
from privkit.mechanisms.clipping import clip_l2
from privkit.mechanisms.sampling import gaussian_noise

__all__ = [
    "Sensitivity",
    "Solver",
    "GaussianOutputPerturbation",
    "trainable_parameters",
]


class Sensitivity(enum.Enum):
    """How the L2 sensitivity of a clipped, locally trained model is bounded."""

    #: 2 tau: any two points of the clipping ball (always valid; the default).
    CLIP_REPLACE_ONE = "clip_replace_one"
    #: tau / |D_i|: Upcycled-FL Thm C.1's assumption (reproduces the paper only).
    PAPER = "paper"
    #: min(2 tau, solver bound) for convex, u1-Lipschitz losses, rho-strongly convex objective.
    STRONGLY_CONVEX = "strongly_convex"


class Solver(enum.Enum):
    """How the local problem is solved; picks the ``STRONGLY_CONVEX`` bound."""

    #: exact minimiser: 2 u1 / (|D_i| rho).
    EXACT = "exact"
    #: plain full-batch gradient descent from the common start: 2 u1 / (|D_i| rho).
    FULL_BATCH_GD = "full_batch_gd"
    #: plain minibatch SGD with b distinct records per batch: 2 u1 / (b rho).
    MINIBATCH_SGD = "minibatch_sgd"
    #: a solver certified to stop within e of the minimiser: 2 u1 / (|D_i| rho) + 2 e.
    CERTIFIED = "certified"


# ------------------------------------------------------------ the mechanism
@dataclass(frozen=True)
class GaussianOutputPerturbation:
    """Clip a whole model (any tree) to ``l2_clip_norm``; add Gaussian noise to every coordinate.

    Upcycled-FL output perturbation (Yin et al., arXiv 2310.06341, Sec. 5, Thm
    C.1): ``w_hat = xi(w) + n``, ``xi(w) = w / max(1, ||w||_2 / tau)``,
    ``n ~ N(0, stddev^2 I)``. One call is a Gaussian mechanism, priced exactly by
    ``privkit.epsilon(mech.event(), delta, neighboring_relation=mech.neighboring_relation)``.

    Sensitivity (L2, in the parameters' units; upcycled_fl.md 3.2):

    * ``CLIP_REPLACE_ONE``: ``2 tau`` under replace-one, valid for any training procedure.
    * ``PAPER``: ``tau / dataset_size`` under add/remove. This is Thm C.1's assumption that
      the clipped model is an average ``(1/|D|) sum_d eta(d)`` of per-example terms
      with ``||eta|| <= tau`` (add-one neighbours); it does not hold for a model
      trained by SGD and then clipped. Use it only to reproduce the paper.
    * ``STRONGLY_CONVEX``: ``min(2 tau, bound)`` under replace-one, for per-example losses
      that are convex with gradient norm <= u1 (``lipschitz``) and a local objective that
      is rho-strongly convex (``strong_convexity``, rho >= proximal mu):

      - ``Solver.EXACT`` or ``FULL_BATCH_GD`` (plain steps, step size <=
        2/(beta + 2 mu), common start): ``2 u1 / (|D_i| rho)``;
      - ``Solver.MINIBATCH_SGD`` (plain steps, b distinct records per batch):
        ``2 u1 / (b rho)``, because the differing record may be in every batch;
      - ``Solver.CERTIFIED`` (stops within ``certified_error`` e of the
        minimiser, e.g. ``||grad J|| <= rho e``): ``2 u1 / (|D_i| rho) + 2 e``.

      Clipping is a projection (1-Lipschitz), hence the min. Momentum, dropout
      or a non-convex model void these bounds.

    **The noise.** Give ``stddev`` (absolute, the paper's sigma). ``noise_multiplier`` is
    ``stddev / C`` with ``C`` the bound on one contribution (:attr:`contribution_bound`:
    the sensitivity under add/remove, half of it under replace-one), the meaning it has in
    Opacus and dp-accounting's PLD and in every privkit event; the accountant doubles the
    sensitivity under replace-one. Before privkit-fl 0.2 a replace-one mode read
    ``noise_multiplier`` as ``stddev / (2 tau)``: the same number now means half that noise,
    so in the replace-one modes (``CLIP_REPLACE_ONE``, ``STRONGLY_CONVEX``) a call that gives
    ``noise_multiplier`` without ``stddev`` is refused (the message gives the ``stddev`` the
    old reading drew); ``PAPER`` (add/remove) reads it as before.

    Only what is passed is noised: use :func:`trainable_parameters` for a torch
    module (buffers such as BatchNorm statistics are never included).

    Attributes:
        l2_clip_norm: tau, L2 radius (parameter units) of the clip, finite and > 0.
        noise_multiplier: z = stddev / :attr:`contribution_bound` (unitless), finite and > 0;
            derived from ``stddev`` when that is given.
        sensitivity_mode: a :class:`Sensitivity` (default ``CLIP_REPLACE_ONE``).
        dataset_size: |D_i|, records of the client (``PAPER``, ``STRONGLY_CONVEX``).
        lipschitz: u1, bound on per-example gradient norms (``STRONGLY_CONVEX``).
        strong_convexity: rho, strong convexity of the local objective (``STRONGLY_CONVEX``).
        solver: a :class:`Solver` (``STRONGLY_CONVEX`` only; default ``EXACT``).
        batch_size: b, records per minibatch (``Solver.MINIBATCH_SGD``), 1 <= b <= |D_i|.
        certified_error: e >= 0, certified distance to the minimiser (``Solver.CERTIFIED``).
        stddev: absolute noise standard deviation per coordinate (parameter units), finite
            and > 0 (keyword only); derived from ``noise_multiplier`` when that is given.

    Raises:
        InvalidParameterError: a bad value, a field the mode needs but lacks, a field given
            that the mode does not use, or a replace-one ``noise_multiplier`` without
            ``stddev`` (each names the field).

    Example:
        >>> import numpy as np
        >>> mech = GaussianOutputPerturbation(l2_clip_norm=1.0, stddev=4.0)
        >>> mech.sensitivity, mech.contribution_bound, mech.noise_multiplier
        (2.0, 1.0, 4.0)
        >>> model = {"w": np.full(3, 10.0, dtype=np.float32), "b": np.zeros(1, np.float32)}
        >>> out = mech(model, rng=np.random.default_rng(0))
        >>> sorted(out), out["w"].shape, out["w"].dtype
        (['b', 'w'], (3,), dtype('float32'))
        >>> mech.event(), mech.neighboring_relation.name
        (ReplaceOneGaussianDpEvent(noise_multiplier=4.0), 'REPLACE_ONE')
        >>> paper = GaussianOutputPerturbation.from_stddev(
        ...     10.0, 0.8, sensitivity_mode=Sensitivity.PAPER, dataset_size=224)
        >>> round(paper.noise_multiplier, 6)
        17.92
    """

    l2_clip_norm: float
    noise_multiplier: float | None = None
    sensitivity_mode: Sensitivity = Sensitivity.CLIP_REPLACE_ONE
    dataset_size: int | None = None
    lipschitz: float | None = None
    strong_convexity: float | None = None
    solver: Solver = Solver.EXACT
    batch_size: int | None = None
    certified_error: float | None = None
    stddev: float | None = field(default=None, kw_only=True)
    _noise_scale: float = field(default=1.0, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("l2_clip_norm", _validate.positive("l2_clip_norm", self.l2_clip_norm))
        put("noise_multiplier", _optional("noise_multiplier", self.noise_multiplier,
                                          _validate.positive))
        put("stddev", _optional("stddev", self.stddev, _validate.positive))
        put("_noise_scale", _check_noise_scale(self._noise_scale))
        _check_enum("sensitivity_mode", self.sensitivity_mode, Sensitivity)
        _check_enum("solver", self.solver, Solver)
        put("dataset_size", _optional("dataset_size", self.dataset_size, _validate.positive_int))
        put("lipschitz", _optional("lipschitz", self.lipschitz, _validate.positive))
        put("strong_convexity",
            _optional("strong_convexity", self.strong_convexity, _validate.positive))
        put("batch_size", _optional("batch_size", self.batch_size, _validate.positive_int))
        put("certified_error",
            _optional("certified_error", self.certified_error, _validate.nonnegative))

        mode = self.sensitivity_mode
        needed: tuple[str, ...] = ()
        if mode is Sensitivity.PAPER:
            needed = ("dataset_size",)
        elif mode is Sensitivity.STRONGLY_CONVEX:
            needed = ("dataset_size", "lipschitz", "strong_convexity")
            if self.solver is Solver.MINIBATCH_SGD:
                needed += ("batch_size",)
            if self.solver is Solver.CERTIFIED:
                needed += ("certified_error",)
        for name in needed:
            if getattr(self, name) is None:
                raise InvalidParameterError(name, None, f"given for {mode} with {self.solver}"
                                            if mode is Sensitivity.STRONGLY_CONVEX
                                            else f"given for {mode}")
        for name in ("dataset_size", "lipschitz", "strong_convexity", "batch_size",
                     "certified_error"):
            if name not in needed and getattr(self, name) is not None:
                raise InvalidParameterError(
                    name, getattr(self, name),
                    f"None: {mode} with {self.solver} does not use it (it would be ignored)")
        if mode is not Sensitivity.STRONGLY_CONVEX and self.solver is not Solver.EXACT:
            raise InvalidParameterError(
                "solver", self.solver, f"Solver.EXACT (the default): {mode} does not use it")
        if self.batch_size is not None and self.batch_size > self.dataset_size:  # type: ignore[operator]
            raise InvalidParameterError(
                "batch_size", self.batch_size, f"<= dataset_size = {self.dataset_size}")
        s = self.sensitivity
        if not (np.isfinite(s) and s > 0):
            raise InvalidParameterError("l2_clip_norm", self.l2_clip_norm,
                                        f"such that the sensitivity ({s!r}) is finite and > 0")
        c = self.contribution_bound
        z, sd = self.noise_multiplier, self.stddev
        if z is None and sd is None:
            raise InvalidParameterError("stddev", None, "given (or noise_multiplier)")
        if sd is None:
            assert z is not None
            if self.neighboring_relation.name == "REPLACE_ONE":
                raise InvalidParameterError(
                    "noise_multiplier", z,
                    f"replaced by stddev in {mode}: since privkit-fl 0.2 a noise multiplier "
                    f"is stddev / C, C = {c:.6g} the bound on one contribution (the "
                    "accountant doubles the sensitivity under replace-one); it used to mean "
                    "stddev / (2 C) here, so the same number would now draw half the noise. "
                    f"Pass stddev={z * s!r} for the noise this call drew before "
                    f"(stddev={z * c!r} in the new reading)")
            sd = z * c
        elif z is None:
            z = sd / c
        elif not math.isclose(sd, z * c, rel_tol=1e-12):
            raise InvalidParameterError(
                "stddev", sd, f"noise_multiplier * contribution bound = {z * c!r} when both are "
                "given (give one)")
        if not (math.isfinite(z) and z > 0 and z * c >= sys.float_info.min
                and sd >= sys.float_info.min):
            raise InvalidParameterError(
                "stddev", sd, f"a normal float (>= {sys.float_info.min:.3g}) with a finite "
                f"noise_multiplier = stddev / C (C = {c!r})")
        put("noise_multiplier", float(z))
        put("stddev", float(sd))

    @classmethod
    def from_stddev(
        cls, l2_clip_norm: float, stddev: float, **kw: Any
    ) -> GaussianOutputPerturbation:
        """Build from an absolute stddev (the paper's sigma), as ``cls(l2_clip_norm,
        stddev=stddev, **kw)``.

        Args:
            l2_clip_norm: tau, finite and > 0.
            stddev: absolute noise standard deviation (parameter units), finite and > 0.
            **kw: the other fields (mode, dataset_size, ...).

        Example:
            >>> m = GaussianOutputPerturbation.from_stddev(1.0, 3.0)
            >>> m.noise_multiplier, m.sensitivity
            (3.0, 2.0)
        """
        return cls(l2_clip_norm, stddev=stddev, **kw)

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity Delta of one release (parameter units), per the mode, under
        :attr:`neighboring_relation`."""
        tau = self.l2_clip_norm
        mode = self.sensitivity_mode
        if mode is Sensitivity.CLIP_REPLACE_ONE:
            return 2.0 * tau
        n = float(self.dataset_size)  # type: ignore[arg-type]
        if mode is Sensitivity.PAPER:
            return tau / n
        u1, rho = float(self.lipschitz), float(self.strong_convexity)  # type: ignore[arg-type]
        if self.solver is Solver.MINIBATCH_SGD:
            bound = 2.0 * u1 / (float(self.batch_size) * rho)  # type: ignore[arg-type]
        else:
            bound = 2.0 * u1 / (n * rho)
            if self.solver is Solver.CERTIFIED:
                bound += 2.0 * float(self.certified_error)  # type: ignore[arg-type]
        return min(2.0 * tau, bound)

    @property
    def contribution_bound(self) -> float:
        """C, the bound on one contribution that :attr:`noise_multiplier` is relative to:
        :attr:`sensitivity` under add/remove (``PAPER``), half of it under replace-one."""
        s = self.sensitivity
        return s / 2.0 if self.neighboring_relation.name == "REPLACE_ONE" else s

    @property
    def neighboring_relation(self) -> Any:
        """The relation :attr:`sensitivity` is for, to price :meth:`event` under.

        ``REPLACE_ONE`` (one record of the client replaced) for ``CLIP_REPLACE_ONE`` and
        ``STRONGLY_CONVEX``; ``ADD_OR_REMOVE_ONE`` for ``PAPER`` (Thm C.1's add-one
        neighbours): ``privkit.epsilon(mech.event(), delta,
        neighboring_relation=mech.neighboring_relation)``.
        """
        from privkit.events.mechanisms import NeighboringRelation

        if self.sensitivity_mode is Sensitivity.PAPER:
            return NeighboringRelation.ADD_OR_REMOVE_ONE
        return NeighboringRelation.REPLACE_ONE

    def __call__(self, tree: Any, *, rng: Any) -> Any:
        """Clip ``tree`` as one vector to ``l2_clip_norm``; add N(0, stddev^2) to each coordinate.

        Args:
            tree: a numpy array, torch tensor, or list/tuple/dict of them (e.g.
                ``trainable_parameters(model)``), floating point, non-empty, finite.
            rng: ``numpy.random.Generator``, ``torch.Generator`` or
                ``privkit.mechanisms.sampling.SecureRandom``.

        Returns:
            A new tree of the same structure, shapes, dtypes and devices (noise
            added in float64, then cast back), with no autograd history.
        """
        _check_tree("tree", tree)
        stddev = float(self.stddev)  # type: ignore[arg-type]
        z = float(self.noise_multiplier)  # type: ignore[arg-type]
        # the accounted multiplier is the one used (Opacus #11)
        if not math.isclose(stddev, z * self.contribution_bound, rel_tol=1e-12):
            raise AssertionError("stddev != noise_multiplier * contribution_bound")
        with _no_grad():
            clipped = clip_l2(tree, self.l2_clip_norm)
            noise = gaussian_noise(clipped, stddev, rng=rng)
            return _add_noise(clipped, noise, self._noise_scale)

    def event(self) -> GaussianDpEvent:
        """The event of one release, to price under :attr:`neighboring_relation`:
        ``ReplaceOneGaussianDpEvent(noise_multiplier)`` in the replace-one modes (a
        ``GaussianDpEvent`` that privkit refuses to price under any other relation, where its
        contribution bound would be read as the sensitivity: half the truth), or
        ``GaussianDpEvent(noise_multiplier)`` for ``PAPER`` (add/remove)."""
        z = float(self.noise_multiplier)  # type: ignore[arg-type]
        if self.neighboring_relation.name == "REPLACE_ONE":
            return ReplaceOneGaussianDpEvent(z)
        return GaussianDpEvent(z)


def trainable_parameters(module: Any) -> dict[str, Any]:
    """The parameters of a torch module that require gradients, by name; never buffers.

    Args:
        module: a ``torch.nn.Module`` with at least one trainable parameter.

    Returns:
        ``{name: parameter}`` in ``named_parameters()`` order (the tensors
        themselves, not copies).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        >>> net[1].weight.requires_grad_(False)  # doctest: +ELLIPSIS
        Parameter containing:...
        >>> list(trainable_parameters(net))
        ['0.weight', '0.bias', '1.bias']
    """
    torch = _torch()
    if torch is None or not isinstance(module, torch.nn.Module):
        raise InvalidParameterError("module", type(module).__name__, "a torch.nn.Module")
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if not params:
        raise InvalidParameterError("module", type(module).__name__,
                                    "a module with at least one trainable parameter")
    return params
