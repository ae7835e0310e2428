"""SCFL's gradients and aggregation (pure functions of the data, the coded rows and W)."""

from __future__ import annotations

from typing import Any

import numpy as np

from privkit.errors import InvalidParameterError

__all__ = ["client_gradient", "server_gradient", "makeup_term", "aggregate"]


def client_gradient(x: np.ndarray, y: np.ndarray, w: np.ndarray, rows: np.ndarray,
                    scale: float) -> np.ndarray:
    """g_i = scale * X_B^T (X_B W - Y_B) on the rows ``rows`` (scale = l_i / b_i)."""
    xb = x[rows]
    return scale * (xb.T @ (xb @ w - y[rows]))


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
