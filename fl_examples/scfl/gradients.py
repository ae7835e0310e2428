"""SCFL's gradients and aggregation (pure functions of the data, the coded rows and W)."""

from __future__ import annotations

from typing import Any

import numpy as np

from privkit.errors import InvalidParameterError

__all__ = ["client_gradient", "dp_client_gradient", "server_gradient", "makeup_term",
           "aggregate"]


def client_gradient(x: np.ndarray, y: np.ndarray, w: np.ndarray, rows: np.ndarray,
                    scale: float) -> np.ndarray:
    """g_i = scale * X_B^T (X_B W - Y_B) on the rows ``rows`` (scale = l_i / b_i)."""
    xb = x[rows]
    return scale * (xb.T @ (xb @ w - y[rows]))


def dp_client_gradient(x: np.ndarray, y: np.ndarray, w: np.ndarray, rows: np.ndarray,
                       scale: float, clip: float, noise: np.ndarray) -> np.ndarray:
    """Record-level DP-SGD's g_i: ``scale * (sum_j f_j x_j r_j^T + noise)`` on the Poisson
    rows ``rows``, ``r_j = x_j^T W - y_j``, ``f_j = min(1, C / (||x_j|| ||r_j||))`` (the
    Frobenius norm of the example's gradient, formed without materialising it), shrunk by a
    few ulps so that rounding cannot let a clipped gradient exceed C; ``noise`` is
    N(0, (z C)^2) of shape ``w.shape`` and ``scale`` = 1 / q_i (l_i / b_i)."""
    xb = x[rows]
    r = xb @ w - y[rows]
    norms = np.sqrt(np.einsum("ij,ij->i", xb, xb) * np.einsum("ij,ij->i", r, r))
    f = np.minimum(1.0, clip / np.maximum(norms, 1e-300)) * (1.0 - 8 * np.finfo(np.float64).eps)
    return scale * (xb.T @ (r * f[:, None]) + noise)


def server_gradient(cx: np.ndarray, cy: np.ndarray, w: np.ndarray, rows: np.ndarray,
                    batch_size: float) -> np.ndarray:
    """g_s = (1/b_s) X^_s^T (X^_s W - Y^_s) on the coded rows ``rows``."""
    xb = cx[rows]
    return (xb.T @ (xb @ w - cy[rows])) / batch_size


def makeup_term(w: np.ndarray, noise_variance_sum: float) -> np.ndarray:
    """g_o = -(sum_i sigma_i^2) W: removes the coding noise's bias from E[g_s]."""
    return -noise_variance_sum * w


def aggregate(client_grads: Any, arrived: Any, p: Any, g_s: np.ndarray, g_o: np.ndarray,
              kappa: float) -> np.ndarray:
    """g = kappa sum_i 1{arrived_i} g_i / p_i + (1 - kappa)(g_s + g_o).

    ``client_grads`` is (n, d, o) (or a list); clients with p_i = 0 must not have arrived.
    """
    g = np.asarray(client_grads, dtype=np.float64)
    a = np.asarray(arrived, dtype=bool)
    pr = np.asarray(p, dtype=np.float64)
    if (a & ~(pr > 0)).any():
        raise InvalidParameterError("arrived", a.tolist(), "False where p_i = 0")
    weights = np.where(a, 1.0 / np.where(pr > 0, pr, 1.0), 0.0)
    return kappa * np.tensordot(weights, g, axes=1) + (1 - kappa) * (g_s + g_o)
