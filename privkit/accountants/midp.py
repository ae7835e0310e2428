"""Mutual-information DP (MI-DP) of SCFL's one-time coded upload, in nats (bits on request).

**Definition** (Cuff and Yu, "Differential Privacy as a Mutual Information Constraint", ACM CCS
2016). A mechanism M is epsilon-MI-DP if, for every record j and every distribution of the data
set,

    I(x_j ; M(X) | X_{-j}) <= epsilon        (natural logarithms: nats).

It bounds the *average* information one release carries about one record when all other
records are known. privkit reports it as ``mi_dp_nats``, never as an ``epsilon``.

**The release.** Client i uploads once, before training (SCFL, Sun et al., ISIT 2022):

    X~ = G X + sigma N            G in R^{c x l}, N in R^{c x d}, iid N(0, 1), both secret
    Y~ = G Y + sigma_y N_y        (privkit's default, ``LabelMode.NOISY``)
    Y~ = G Y                      (the paper, ``LabelMode.PAPER_NOISELESS``)

**Theorem F (features only).** With every row clipped to ``||x_j|| <= rho`` and
``snr = rho^2 / sigma^2``::

    eps_x = min{ (c/2) psi_d(snr),  (d/2) log(1 + c snr / d) }              [nats]
    psi_d(snr) = max_{mu in [0,1]} [ d log(1 + mu snr/d) - mu log(1 + snr) ],
    mu* = min{ 1, d (1/log(1+snr) - 1/snr) }

and for d = 1 also the bound B3 on log ||X~||^2 (see :func:`midp_coded_features`). The first
term holds while G stays secret, the second even if G leaks. It does not depend on l.

**Labels.** ``NOISY``: the record is ``z = [x, (sigma/sigma_y) y]`` in R^{d+o}, so Theorem F
applies with ``d + o`` and ``rho_z^2 = rho_x^2 + (sigma/sigma_y)^2 rho_y^2``; for categorical
(one-hot) labels also ``log o + (d/2) log(1 + c rho_x^2/(d sigma^2))``, the smaller is
reported. ``PAPER_NOISELESS``: ``Y~ = G Y`` reveals G (``G = Y~ Y^+``) and the labels, so the
features-only number is void: continuous labels give ``+inf``; one-hot labels give the
full-disclosure bound ``log o + (d/2) log(1 + c rho_x^2/(d sigma^2))``, flagged "labels fully
disclosed".

**Assumptions** (the mechanism :func:`privkit.mechanisms.coded.code_client_data` enforces the
first three): rows clipped to rho (labels to rho_y); G and all noise drawn from the client's
own generator, never logged, stored or reused; each client codes once (several codings of the
same data add: MI is subadditive over releases independent given the data,
:func:`compose_midp`); worst case over the other records and over the input law.

**Scope.** Only the coded upload. In SCFL each client also uploads a noise-free gradient of a
batch of its raw rows every epoch; that is not covered ("per-epoch client gradients
unprotected").

**Relation to (epsilon, delta)-DP** (record-level, replace-one):

* epsilon-DP implies MI-DP with ``I <= epsilon tanh(epsilon/2) <= min(epsilon, epsilon^2/2)``;
  zCDP rho implies ``I <= rho``.
* (epsilon, delta)-DP with delta > 0 implies *no* finite MI-DP for continuous records.
* epsilon-MI-DP implies only (0, sqrt(2 epsilon))-DP (Pinsker on the Jensen-Shannon
  divergence), and never pure epsilon'-DP: a mechanism that reveals a binary record outright
  with probability epsilon / ln 2 is epsilon-MI-DP. So an MI-DP number is an average-case
  statement; it is never composed with, or compared to, an epsilon.

Importing this module registers :class:`CodedDataMiEvent` with :mod:`privkit.events` (JSON
round trip) and with the accounting rules, so every (epsilon, delta) accountant and the
ledger refuse it with a message saying it is an MI-DP release.

Examples:
    >>> round(midp_coded_features(1000, 4.0, 1.0, 784), 6)
    0.936444
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privkit import _validate
from privkit._numerics import special
from privkit.accountants import rules
from privkit.errors import InvalidParameterError, NumericalError, UnsupportedEventError
from privkit.events import CodedDataMiEvent, LabelMode, register_event_module

__all__ = [
    "LabelMode",
    "CodedDataMiEvent",
    "MiDpReport",
    "COVERS",
    "REPORT_LABEL",
    "nats_to_bits",
    "midp_coded_features",
    "midp_coded_release",
    "midp_per_client",
    "compose_midp",
    "implied_tv_delta",
]

#: What every MI-DP number of the coded upload covers, and what it does not.
COVERS = "coded upload only; per-epoch client gradients unprotected"
#: The label every report carries.
REPORT_LABEL = ("MI-DP (Cuff-Yu), nats, average-case; " + COVERS
                + "; implies only (0, sqrt(2 eps))-DP")
_LN2 = math.log(2.0)
#: Below this snr the closed form of mu* cancels; its series is used instead.
_SMALL_SNR = 1e-6


register_event_module(__name__)


@dataclass(frozen=True)
class MiDpReport:
    """An MI-DP upper bound of one release (or a composition) for one client.

    Attributes:
        nats: upper bound on I(record; release | other records), nats; ``inf`` if unbounded.
        method: which bound gave the number.
        label_mode: how labels were uploaded.
        labels_fully_disclosed: True when the number is the full-disclosure bound of
            ``PAPER_NOISELESS`` one-hot labels (or inf for continuous ones).
        covers: what the number covers (:data:`COVERS`).
        assumptions: the conditions it rests on, one phrase each.
    """

    nats: float
    method: str
    label_mode: LabelMode
    labels_fully_disclosed: bool
    covers: str = COVERS
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bits(self) -> float:
        return nats_to_bits(self.nats)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the number is under ``mi_dp_nats`` (never ``epsilon``)."""
        return {"mi_dp_nats": self.nats, "mi_dp_bits": self.bits, "measure": "mi_dp_nats",
                "method": self.method, "label_mode": self.label_mode.value,
                "labels_fully_disclosed": self.labels_fully_disclosed, "covers": self.covers,
                "implied_tv_delta": implied_tv_delta(self.nats), "label": REPORT_LABEL,
                "assumptions": list(self.assumptions)}

    def __str__(self) -> str:
        flag = "  [labels fully disclosed]" if self.labels_fully_disclosed else ""
        s = (f"MI-DP <= {self.nats:.6g} nats ({self.bits:.6g} bits)  [{self.method}]{flag}\n"
             f"  covers: {self.covers}")
        return s + "".join(f"\n  - {a}" for a in self.assumptions)


def nats_to_bits(nats: Any) -> Any:
    """nats / ln 2 (inf stays inf)."""
    return np.asarray(nats, dtype=np.float64) / _LN2 if np.ndim(nats) else float(nats) / _LN2


def implied_tv_delta(nats: float) -> float:
    """delta of the (0, delta)-DP an MI-DP bound implies: ``min(1, sqrt(2 nats))``."""
    x = _validate.nonnegative_or_inf("nats", nats)
    return min(1.0, math.sqrt(2.0 * x)) if math.isfinite(x) else 1.0


# --------------------------------------------------------------------------- the bounds
def _log1p_minus_x(x: np.ndarray) -> np.ndarray:
    """log(1 + x) - x for x >= 0, accurate at small x (a series below 1e-2)."""
    out = np.empty_like(x)
    small = x < 1e-2
    xs = x[small]
    # -x^2/2 + x^3/3 - ... - x^10/10: truncation below 1e-22 relative to x^2.
    acc = np.zeros_like(xs)
    for k in range(10, 1, -1):
        acc = acc * xs + ((-1.0) ** (k + 1)) / k
    out[small] = acc * xs * xs
    big = ~small
    out[big] = np.log1p(x[big]) - x[big]
    return out


def _h_log_chi2(k: np.ndarray) -> np.ndarray:
    """Differential entropy (nats) of log U, U ~ chi^2 with k degrees of freedom."""
    h = k / 2
    return h + special.gammaln(h) + (1 - h) * special.digamma(h) - special.digamma(h)


def _check_arrays(c: Any, sigma: Any, rho: Any, d: Any) -> tuple[np.ndarray, ...]:
    def arr(name: str, v: Any) -> np.ndarray:
        raw = np.asarray(v) if not isinstance(v, bool) else None
        if raw is None or raw.dtype == np.bool_:
            raise InvalidParameterError(name, v, "a real number or array, not a bool")
        try:
            a = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidParameterError(name, v, "a real number or array") from None
        return a

    ca, sa, ra, da = (arr("num_coded_rows", c), arr("stddev", sigma), arr("row_l2_bound", rho),
                      arr("dim", d))
    for name, a, ok in (
        ("num_coded_rows", ca, np.isfinite(ca) & (ca >= 1) & (ca == np.floor(ca))),
        ("stddev", sa, np.isfinite(sa) & (sa >= 0)),
        ("row_l2_bound", ra, np.isfinite(ra) & (ra >= 0)),
        ("dim", da, np.isfinite(da) & (da >= 1) & (da == np.floor(da))),
    ):
        if not ok.all():
            bad = a.ravel()[np.flatnonzero(~ok.ravel())[0]]
            req = {"num_coded_rows": "an integer >= 1", "dim": "an integer >= 1",
                   "stddev": "finite and >= 0 (0 gives inf)",
                   "row_l2_bound": "finite and >= 0"}[name]
            raise InvalidParameterError(name, float(bad), req)
    try:
        return tuple(np.broadcast_arrays(ca, sa, ra, da))
    except ValueError:
        raise InvalidParameterError("shapes", (ca.shape, sa.shape, ra.shape, da.shape),
                                    "broadcastable") from None


def _features_bound(c: np.ndarray, sigma: np.ndarray, rho: np.ndarray, d: np.ndarray
                    ) -> np.ndarray:
    """Theorem F, elementwise on validated, broadcast float64 arrays."""
    out = np.full(c.shape, np.inf)
    ok = sigma > 0
    with np.errstate(over="ignore"):  # sigma so small that snr overflows: no privacy (inf)
        ok &= np.isfinite((rho / np.where(ok, sigma, 1.0)) ** 2)
    c, sigma, rho, d = c[ok], sigma[ok], rho[ok], d[ok]
    snr = (rho / sigma) ** 2
    small = snr < _SMALL_SNR
    safe = np.where(small, 1.0, snr)
    r = np.where(small, 0.5 - snr / 12 + snr**2 / 24, 1 / np.log1p(safe) - 1 / safe)
    mu = np.minimum(1.0, d * r)
    # d log(1 + mu snr/d) - mu log(1 + snr), written without the cancelling linear terms.
    psi = d * _log1p_minus_x(mu * snr / d) - mu * _log1p_minus_x(snr)
    psi = np.maximum(psi, 0.0)  # >= 0 exactly (mu = 0 is feasible); only rounding is removed
    eps = np.minimum(c / 2 * psi, d / 2 * np.log1p(c * snr / d))
    one = d == 1
    if one.any():
        k = c[one]
        b3 = 0.5 * np.log(2 * math.pi * math.e * (np.log1p(snr[one]) ** 2 / 4
                                                  + special.polygamma(1, k / 2))) - _h_log_chi2(k)
        eps[one] = np.minimum(eps[one], b3)
    out[ok] = eps
    return out


def midp_coded_features(num_coded_rows: Any, stddev: Any, row_l2_bound: Any, dim: Any, *,
                        bits: bool = False) -> Any:
    """Theorem F: MI-DP of a features-only coded upload, vectorised (numpy broadcasting).

    ``min{(c/2) psi_d(snr), (d/2) log(1 + c snr/d)}`` with ``snr = rho^2/sigma^2``, and for
    ``d == 1`` also ``B3 = (1/2) log(2 pi e (log(1+snr)^2/4 + trigamma(c/2))) - h(log chi2_c)``.

    Args:
        num_coded_rows: c, integer >= 1 (array or scalar).
        stddev: sigma, absolute feature-noise stddev, >= 0; 0 gives inf.
        row_l2_bound: rho, the rows' L2 clipping bound, >= 0 (0: nothing is released).
        dim: d, number of columns, integer >= 1.
        bits: return bits instead of nats.

    Returns:
        A float for scalar inputs, else a float64 array of the broadcast shape.

    Raises:
        InvalidParameterError: NaN, inf, negative or non-integer arguments (named).
        NumericalError: if a bound came out NaN.

    Examples:
        >>> midp_coded_features([1, 10, 100], 1.0, 1.0, 1).round(6).tolist()
        [0.02983, 0.234176, 0.970744]
    """
    c, s, r, d = _check_arrays(num_coded_rows, stddev, row_l2_bound, dim)
    out = _features_bound(c.astype(np.float64), s, r, d)
    if np.isnan(out).any():
        raise NumericalError("MI-DP bound came out NaN; refusing to report it")
    if bits:
        out = out / _LN2
    return float(out) if out.ndim == 0 else out


def _categorical_bound(c: Any, sigma: Any, rho_x: Any, d: Any, o: Any) -> Any:
    """``log o + (d/2) log(1 + c rho_x^2/(d sigma^2))``: full label disclosure, G known."""
    with np.errstate(divide="ignore"):
        snr = np.where(np.asarray(sigma) > 0, np.asarray(rho_x) ** 2
                       / np.maximum(np.asarray(sigma, dtype=float), 1e-300) ** 2, np.inf)
    return np.log(o) + np.asarray(d) / 2 * np.log1p(np.asarray(c) * snr / np.asarray(d))


def _assumptions(ev: CodedDataMiEvent) -> tuple[str, ...]:
    out = [f"rows clipped to L2 <= {ev.row_l2_bound:g} (bias column included); "
           f"c = {ev.num_coded_rows}, sigma = {ev.stddev:g}, d = {ev.dim}",
           "G and the noise secret (client's private generator, never stored or reused)",
           "the client codes once (further codings add their bounds)"]
    if ev.label_mode is LabelMode.NOISY:
        out.append(f"labels clipped to L2 <= {ev.label_l2_bound:g} and noised with "
                   f"sigma_y = {ev.label_stddev:g} (o = {ev.label_dim})")
    elif ev.label_mode is LabelMode.PAPER_NOISELESS:
        out.append("labels uploaded without noise (the paper's scheme): Y~ = G Y reveals G "
                   "and the labels; labels fully disclosed")
    else:
        out.append("no labels uploaded")
    return tuple(out)


def _release_arrays(events: Sequence[CodedDataMiEvent]) -> tuple[np.ndarray, list[str]]:
    """Per-event nats and method names, vectorised over the events."""
    for i, ev in enumerate(events):
        if not isinstance(ev, CodedDataMiEvent):
            raise InvalidParameterError(f"events[{i}]", ev, "a CodedDataMiEvent")
    k = len(events)
    c = np.array([e.num_coded_rows for e in events], dtype=np.float64)
    s = np.array([e.stddev for e in events], dtype=np.float64)
    rx = np.array([e.row_l2_bound for e in events], dtype=np.float64)
    d = np.array([e.dim for e in events], dtype=np.float64)
    o = np.array([e.label_dim for e in events], dtype=np.float64)
    modes = [e.label_mode for e in events]
    noisy = np.array([m is LabelMode.NOISY for m in modes], dtype=bool)
    paper = np.array([m is LabelMode.PAPER_NOISELESS for m in modes], dtype=bool)
    cat = np.array([e.categorical_labels for e in events], dtype=bool)
    sy = np.array([e.label_stddev if e.label_stddev > 0 else 1.0 for e in events])
    ry = np.array([e.label_l2_bound if e.label_l2_bound is not None else 1.0 for e in events])
    # NOISY: the augmented record z = [x, (sigma/sigma_y) y] in R^{d+o}.
    rho_z = np.where(noisy, np.sqrt(rx**2 + (s / sy) ** 2 * ry**2), rx)
    dz = np.where(noisy, d + o, d)
    nats = _features_bound(c, s, rho_z, dz) if k else np.zeros(0)
    methods = ["Theorem F (features only)" if m is LabelMode.NONE else
               "Theorem F on [x, (sigma/sigma_y) y] (d + o)" for m in modes]
    if (cat & (noisy | paper)).any():
        with np.errstate(invalid="ignore"):
            full = _categorical_bound(c, s, rx, d, np.maximum(o, 1))
        for j in np.flatnonzero(cat & noisy).tolist():
            if full[j] < nats[j]:
                nats[j], methods[j] = full[j], "log o + G-known features bound (one-hot)"
        for j in np.flatnonzero(cat & paper).tolist():
            nats[j] = full[j]
            methods[j] = "full label disclosure: log o + G-known features bound (one-hot)"
    for j in np.flatnonzero(paper & ~cat).tolist():
        nats[j] = math.inf
        methods[j] = "unbounded: noiseless continuous labels (paper's scheme)"
    if np.isnan(nats).any():
        raise NumericalError("MI-DP bound came out NaN; refusing to report it")
    return nats, methods


def midp_coded_release(event: CodedDataMiEvent) -> MiDpReport:
    """The MI-DP report of one client's coded upload (see the module docstring).

    The report holds nats; ``.bits`` converts.

    Examples:
        >>> ev = CodedDataMiEvent(1000, 4.0, 1.0, 784, "NOISY", 4.0, 1.0, 10, True)
        >>> round(midp_coded_release(ev).nats, 5)
        3.60356
        >>> ev = CodedDataMiEvent(1000, 4.0, 1.0, 784, "PAPER_NOISELESS", 0.0, None, 10, True)
        >>> r = midp_coded_release(ev)
        >>> round(r.nats, 3), r.labels_fully_disclosed
        (32.369, True)
    """
    nats, methods = _release_arrays([event])
    fully = event.label_mode is LabelMode.PAPER_NOISELESS
    return MiDpReport(float(nats[0]), methods[0], event.label_mode, fully,
                      COVERS, _assumptions(event))


def midp_per_client(events: Sequence[CodedDataMiEvent], *, bits: bool = False) -> np.ndarray:
    """MI-DP of each client's upload (one event per client), vectorised; nats (or bits)."""
    nats, _ = _release_arrays(list(events))
    return nats / _LN2 if bits else nats


def compose_midp(events: Sequence[CodedDataMiEvent]) -> float:
    """MI-DP of several independent codings of the *same* client's data: the sum (nats).

    Mutual information is subadditive over releases that are independent given the data.
    """
    evs = list(events)
    if not evs:
        raise InvalidParameterError("events", evs, "at least one CodedDataMiEvent")
    return float(math.fsum(midp_per_client(evs)))


# ------------------------------------------------------ epsilon accountants refuse it
def _refuse(event: CodedDataMiEvent) -> None:
    raise UnsupportedEventError(
        "CodedDataMiEvent is an MI-DP release (nats), not an (epsilon, delta) event; it has no "
        "epsilon and cannot be composed with DP events or spent on an epsilon ledger. "
        "Price it with privkit.accountants.midp.midp_coded_release (CLI: privkit midp coded)")


rules.check_atom.register(CodedDataMiEvent)(_refuse)
