"""Objective perturbation (Upcycled-FL, Thm C.2): an L2-Laplace linear term added to the local loss.

On each odd step a client solves (Yin et al., arXiv 2310.06341, Sec. 5 and
Appendix C, Thm C.2)::

    argmin_w  F_i(w; D_i) + (mu/2) ||w - w_bar||^2 + <n, w>,     p(n) ~ exp(-alpha ||n||_2).

The gradient of ``<n, w>`` is ``n``, so an iterative solver adds the same
vector ``n`` to every gradient within the round. ``n = r u`` with
``r ~ Gamma(d, scale 1/alpha)`` and ``u`` uniform on the sphere, d = all
trainable coordinates (mechanisms.md 2.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privkit import _validate
from privkit.errors import InvalidParameterError
from privkit.events import ObjectivePerturbationDpEvent, objective_step_epsilon
from privkit.mechanisms._tree import _check_noise_scale, _check_tree, _no_grad
from privkit.mechanisms.sampling import l2_laplace_noise, tree_map

__all__ = ["ObjectivePerturbation"]


@dataclass(frozen=True)
class ObjectivePerturbation:
    """The random linear term of objective perturbation and the pure-DP event of one step.

    Guarantee (Thm C.2, rank made explicit): one step is pure epsilon-DP with
    ``step_epsilon = 2 alpha u1/|D| + 1.4 rank u2/(|D| mu)``
    (:func:`privkit.events.objective_step_epsilon`), under the
    theorem's conditions:

    (a) the per-example loss is a generalised linear model, convex (the proof's
        ``||A^-1|| <= 1/mu`` needs a positive semi-definite loss Hessian);
    (b) per-example gradient norm < u1 and ``|loss''| <= u2``;
    (c) feature norm <= 1, the bias counted as a feature;
    (d) ``u2 <= 0.5 |D| mu`` (checked here; violating it raises);
    and the local problem is solved **exactly**.

    Where the paper is loose and what privkit does: the paper's constant 2.8
    is 1.4 times the rank 2 of a binary GLM's Hessian difference; K-class
    softmax has rank up to 2(K-1) with u1 = sqrt(2) max||x~||, u2 = max||x~||^2 / 2,
    so ``rank`` is an explicit field. The paper sums m = 0..M (M+1 terms);
    privkit charges one event per release actually made. Conditions (a)-(c) and
    the exact solver cannot be checked by code: ``glm`` and ``exact_solver``
    declare them. Declaring either False refuses, unless ``allow_unproven=True``,
    in which case the event carries ``proven=False`` and every report that
    prices it says ``NOT PROVEN: ...``.

    Attributes:
        alpha: rate of the linear term ``p(n) ~ exp(-alpha ||n||_2)`` (1 / gradient units), > 0.
        dataset_size: |D_i|, records of the client, integer >= 1.
        proximal_mu: mu of the proximal term, > 0.
        lipschitz: u1 (default 1.0, binary logistic loss with ||x~|| <= 1).
        smoothness: u2 (default 0.25, binary logistic loss with ||x~|| <= 1).
        rank: rank bound r of the Hessian difference (default 2, the paper's case).
        glm: the model is a GLM with convex per-example loss (condition (a)).
        exact_solver: the local problem is solved exactly.
        allow_unproven: price a step that violates ``glm``/``exact_solver`` anyway, marked.

    Example:
        >>> import numpy as np
        >>> op = ObjectivePerturbation(alpha=20.0, dataset_size=224, proximal_mu=0.1)
        >>> round(op.step_epsilon, 6), op.proven
        (0.209821, True)
        >>> n = op.linear_term({"w": np.zeros((2, 20), np.float32)}, rng=np.random.default_rng(0))
        >>> n["w"].shape, n["w"].dtype
        ((2, 20), dtype('float32'))
        >>> op.event().epsilon == op.step_epsilon
        True
    """

    alpha: float
    dataset_size: int
    proximal_mu: float
    lipschitz: float = 1.0
    smoothness: float = 0.25
    rank: int = 2
    glm: bool = True
    exact_solver: bool = True
    allow_unproven: bool = False
    _noise_scale: float = field(default=1.0, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("glm", "exact_solver", "allow_unproven"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, getattr(self, name), "a bool")
        put("alpha", _validate.positive("alpha", self.alpha))
        put("dataset_size", _validate.positive_int("dataset_size", self.dataset_size))
        put("proximal_mu", _validate.positive("proximal_mu", self.proximal_mu))
        put("lipschitz", _validate.positive("lipschitz", self.lipschitz))
        put("smoothness", _validate.nonnegative("smoothness", self.smoothness))
        put("rank", _validate.positive_int("rank", self.rank))
        put("_noise_scale", _check_noise_scale(self._noise_scale))
        self.step_epsilon  # noqa: B018  checks condition (d) at construction
        if not self.allow_unproven:
            for name in ("glm", "exact_solver"):
                if not getattr(self, name):
                    raise InvalidParameterError(
                        name, False, "True for Thm C.2 (or pass allow_unproven=True to price "
                        "the step anyway, marked NOT PROVEN in every report)")

    @property
    def step_epsilon(self) -> float:
        """Per-step epsilon: (2 alpha u1 mu + 1.4 rank u2) / (|D| mu) (Thm C.2)."""
        return objective_step_epsilon(
            alpha=self.alpha, lipschitz=self.lipschitz, smoothness=self.smoothness,
            rank=self.rank, dataset_size=self.dataset_size, proximal_mu=self.proximal_mu,
        )

    @property
    def proven(self) -> bool:
        """True when the step is declared to meet Thm C.2 (GLM and exact solver)."""
        return self.glm and self.exact_solver

    def linear_term(self, like_tree: Any, *, rng: Any) -> Any:
        """Draw n with density ~ exp(-alpha ||n||_2) over all coordinates of ``like_tree``.

        Args:
            like_tree: a tree (e.g. ``trainable_parameters(model)``) giving the
                structure, shapes, dtypes and devices; its values are not used.
            rng: ``numpy.random.Generator``, ``torch.Generator`` or ``SecureRandom``.

        Returns:
            A new tree n shaped like ``like_tree``; add ``<n, w>`` (i.e. ``sum(n * w)``
            over leaves) to the local loss, or ``n`` to every gradient, for the whole round.
        """
        _check_tree("like_tree", like_tree)
        with _no_grad():
            noise = l2_laplace_noise(like_tree, self.alpha, rng=rng)
            if self._noise_scale != 1.0:
                s = self._noise_scale
                noise = tree_map(lambda x: x * s, noise)
        return noise

    def event(self) -> ObjectivePerturbationDpEvent:
        """The privkit event of one step (``proven=False`` if run outside Thm C.2)."""
        return ObjectivePerturbationDpEvent(
            epsilon=self.step_epsilon, alpha=self.alpha, lipschitz=self.lipschitz,
            smoothness=self.smoothness, rank=self.rank, dataset_size=self.dataset_size,
            proximal_mu=self.proximal_mu, proven=self.proven,
        )
