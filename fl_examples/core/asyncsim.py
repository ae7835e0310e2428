"""Deterministic event simulator of asynchronous FL: K edges, one cloud, a FIFO buffer.

The protocol (MAPA / AUDP / ASGD, spec ``mapa.md`` sections 2-3): every edge pulls the
current model, computes a gradient, uploads it; the cloud serves the uploads one at a time in
arrival order (FIFO), applies each one (or drops it when it is too stale), and sends the new
model back to that edge only, which starts its next gradient at once. Edges never wait for
each other.

Time model (seconds of a simulated clock, never the wall clock):

* edge k has a compute speed ``s_k`` (drawn once from ``speed_dist``) and a link speed ``l_k``
  (from ``link_dist``);
* its i-th cycle takes ``compute_time_s * J / s_k`` to compute, ``link_time_s * J' / l_k`` to
  upload and ``link_time_s * J'' / l_k`` to receive the new model, where the jitters
  ``J, J', J''`` are i.i.d. Exp(1) (``jitter="exponential"``) or 1 (``jitter="none"``);
* the cloud takes ``cloud_time_s`` per upload; uploads that arrive while it is busy wait in the
  FIFO buffer. Ties in arrival time are served in edge order.

Versions and staleness: the initial model is version 0 and the t-th applied update makes
version t. An edge's *pull version* is the version it was sent. When the cloud serves an upload
the staleness is ``tau = (updates applied so far) - (pull version)``, the number of updates
applied between the pull and this apply. With ``tau_max`` set, an upload with ``tau > tau_max``
is dropped (not applied; the edge is sent the current model), as spec section 11 decides.

Timing never depends on gradient values, so the whole event sequence is a function of the seed
and the settings: :func:`simulate` computes it before any training, as arrays (no Python object
per event). With ``cloud_time_s = 0`` every edge's arrivals form an independent renewal process
and the FIFO order is one sort of all arrival times (``method="vectorized"``); the general case
runs a heap over the K in-flight uploads (``method="events"``). Both draw the same jitters from
per-edge streams, so they agree exactly where both apply (tested).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privkit import _validate
from privkit.errors import InvalidParameterError

__all__ = ["Dist", "parse_dist", "TimingModel", "Schedule", "simulate", "SIM_METHODS"]

SIM_METHODS = ("auto", "vectorized", "events")

# spawn-key tags of the simulator's random streams (part of the reproducibility contract)
_TAG_SPEEDS = 7001
_TAG_LINKS = 7002
_TAG_JITTER = 7003
_BLOCK = 64  # jitter rows drawn at a time by the event path


@dataclass(frozen=True)
class Dist:
    """A positive distribution from a CLI string.

    Forms: ``constant`` (always 1), ``constant:V``, ``exponential:MEAN``, ``lognormal:MU,SIGMA``
    (``exp(N(MU, SIGMA^2))``), ``uniform:A,B`` (0 < A <= B).
    """

    kind: str
    params: tuple[float, ...]

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` positive float64 draws."""
        if self.kind == "constant":
            return np.full(n, self.params[0])
        if self.kind == "exponential":
            out = rng.exponential(self.params[0], n)
        elif self.kind == "lognormal":
            out = rng.lognormal(self.params[0], self.params[1], n)
        else:
            out = rng.uniform(self.params[0], self.params[1], n)
        # an exponential draw can be 0.0 (probability ~2^-53): keep speeds positive
        return np.maximum(out, np.finfo(np.float64).tiny)

    @property
    def spec(self) -> str:
        return self.kind + (":" + ",".join(f"{p:g}" for p in self.params) if self.params else "")


def parse_dist(spec: Any, name: str = "speed_dist") -> Dist:
    """Parse ``constant[:V] | exponential:MEAN | lognormal:MU,SIGMA | uniform:A,B``.

    Raises:
        InvalidParameterError: naming ``name`` for an unknown form or a bad number.

    Example:
        >>> parse_dist("lognormal:0,1")
        Dist(kind='lognormal', params=(0.0, 1.0))
    """
    forms = "constant[:V], exponential:MEAN, lognormal:MU,SIGMA or uniform:A,B"
    if isinstance(spec, Dist):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidParameterError(name, spec, forms)
    kind, _, rest = spec.strip().lower().partition(":")
    try:
        nums = tuple(float(t) for t in rest.split(",")) if rest else ()
    except ValueError:
        raise InvalidParameterError(name, spec, forms) from None
    if not all(math.isfinite(x) for x in nums):
        raise InvalidParameterError(name, spec, f"{forms}, with finite numbers")
    if kind == "constant" and len(nums) <= 1:
        v = nums[0] if nums else 1.0
        if not v > 0:
            raise InvalidParameterError(name, spec, "constant:V with V > 0")
        return Dist("constant", (v,))
    if kind == "exponential" and len(nums) == 1:
        if not nums[0] > 0:
            raise InvalidParameterError(name, spec, "exponential:MEAN with MEAN > 0")
        return Dist(kind, nums)
    if kind == "lognormal" and len(nums) == 2:
        if not nums[1] >= 0:
            raise InvalidParameterError(name, spec, "lognormal:MU,SIGMA with SIGMA >= 0")
        return Dist(kind, nums)
    if kind == "uniform" and len(nums) == 2:
        if not 0 < nums[0] <= nums[1]:
            raise InvalidParameterError(name, spec, "uniform:A,B with 0 < A <= B")
        return Dist(kind, nums)
    raise InvalidParameterError(name, spec, forms)


@dataclass(frozen=True)
class TimingModel:
    """How long edges, links and the cloud take (simulated seconds; see the module docstring).

    Attributes:
        speed_dist: per-edge compute speeds ``s_k`` (a :func:`parse_dist` string).
        link_dist: per-edge link speeds ``l_k``.
        compute_time_s: mean seconds of one gradient at speed 1, > 0.
        link_time_s: mean seconds of one transfer (each way) at link speed 1, >= 0.
        cloud_time_s: seconds the cloud spends per upload, >= 0 (> 0 makes a queue).
        jitter: ``exponential`` (each duration times an Exp(1) draw) or ``none``.
    """

    speed_dist: str = "lognormal:0,1"
    link_dist: str = "constant"
    compute_time_s: float = 1.0
    link_time_s: float = 0.1
    cloud_time_s: float = 0.0
    jitter: str = "exponential"

    def __post_init__(self) -> None:
        parse_dist(self.speed_dist, "speed_dist")
        parse_dist(self.link_dist, "link_dist")
        _validate.positive("compute_time_s", self.compute_time_s)
        _validate.nonnegative("link_time_s", self.link_time_s)
        _validate.nonnegative("cloud_time_s", self.cloud_time_s)
        if self.jitter not in ("exponential", "none"):
            raise InvalidParameterError("jitter", self.jitter, "exponential or none")


@dataclass(frozen=True, eq=False)
class Schedule:
    """The event sequence of one run: cloud events in FIFO (service) order.

    Per event j (arrays of length ``num_events``): ``edge[j]``; ``upload[j]``, the edge's
    0-based upload count; ``pull_version[j]``; ``staleness[j]``; ``applied[j]`` (False:
    dropped for ``staleness > tau_max``); ``version[j]``, the version the apply made (-1 if
    dropped); ``arrival_s[j]`` and ``done_s[j]`` (end of the cloud's service, when the update
    is applied). ``speeds`` and ``link_speeds`` are the per-edge draws.
    """

    num_edges: int
    edge: np.ndarray
    upload: np.ndarray
    pull_version: np.ndarray
    staleness: np.ndarray
    applied: np.ndarray
    version: np.ndarray
    arrival_s: np.ndarray
    done_s: np.ndarray
    speeds: np.ndarray
    link_speeds: np.ndarray
    tau_max: int | None
    method: str

    @property
    def num_events(self) -> int:
        return int(self.edge.size)

    @property
    def num_applied(self) -> int:
        return int(self.applied.sum())

    def uploads_per_edge(self, end: int | None = None) -> np.ndarray:
        """Uploads each edge made among the first ``end`` events (default all)."""
        return np.bincount(self.edge[:end], minlength=self.num_edges)

    def participation(self, end: int | None = None) -> np.ndarray:
        """Share of the first ``end`` events that came from each edge (sums to 1)."""
        counts = self.uploads_per_edge(end).astype(np.float64)
        return counts / max(counts.sum(), 1.0)

    def staleness_histogram(self, end: int | None = None) -> dict[int, int]:
        """{staleness: number of *applied* updates with it} among the first ``end`` events."""
        s = self.staleness[:end][self.applied[:end]]
        vals, counts = np.unique(s, return_counts=True)
        return {int(v): int(c) for v, c in zip(vals, counts)}

    def events_of_edge(self) -> list[np.ndarray]:
        """Per edge, its event indices in upload order (``events_of_edge()[k][i]``)."""
        order = np.lexsort((self.upload, self.edge))
        bounds = np.searchsorted(self.edge[order], np.arange(self.num_edges + 1))
        return [order[bounds[k]:bounds[k + 1]] for k in range(self.num_edges)]

    def expected_participation(self, timing: TimingModel) -> np.ndarray:
        """Shares predicted by renewal theory when the cloud never queues (cloud_time_s = 0)."""
        rate = 1.0 / (timing.compute_time_s / self.speeds
                      + 2.0 * timing.link_time_s / self.link_speeds)
        return rate / rate.sum()


def _edge_rng(seed: int, k: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_JITTER, k)))


def _jitter(rng: np.random.Generator, n: int, jitter: str) -> np.ndarray:
    """(n, 3) rows (compute, upload, download) of jitter; the stream's prefix is fixed."""
    if jitter == "none":
        return np.ones((n, 3))
    return rng.standard_exponential(size=(n, 3))


def _per_edge(seed: int, k_edges: int, timing: TimingModel) -> tuple[np.ndarray, np.ndarray]:
    sp = parse_dist(timing.speed_dist, "speed_dist").draw(
        np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_SPEEDS,))), k_edges)
    ln = parse_dist(timing.link_dist, "link_dist").draw(
        np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_TAG_LINKS,))), k_edges)
    return sp, ln


def simulate(num_edges: int, num_updates: int, timing: TimingModel | None = None, *,
             seed: int, tau_max: int | None = None, method: str = "auto",
             max_events: int | None = None) -> Schedule:
    """Simulate until ``num_updates`` updates are applied (deterministic for ``seed``).

    Args:
        num_edges: K >= 1.
        num_updates: applied updates to reach, >= 1.
        timing: the :class:`TimingModel` (default: lognormal(0, 1) speeds).
        seed: root seed (>= 0) of the speeds and the per-edge jitter streams.
        tau_max: drop uploads staler than this (None: apply everything).
        method: ``auto`` (vectorized when ``cloud_time_s == 0``), ``vectorized`` or ``events``.
        max_events: give up after this many uploads (default 50 * num_updates + K).

    Raises:
        InvalidParameterError: a bad argument, or ``tau_max`` so small that fewer than
            ``num_updates`` uploads are applied within ``max_events`` (names ``tau_max``).

    Example:
        >>> s = simulate(3, 5, TimingModel(jitter="none", speed_dist="constant"), seed=0)
        >>> s.edge.tolist(), s.staleness.tolist()
        ([0, 1, 2, 0, 1], [0, 1, 2, 2, 2])
    """
    k_edges = _validate.positive_int("num_edges", num_edges)
    n_upd = _validate.positive_int("num_updates", num_updates)
    timing = TimingModel() if timing is None else timing
    if not isinstance(timing, TimingModel):
        raise InvalidParameterError("timing", timing, "a TimingModel")
    seed = _validate.nonnegative_int("seed", seed)
    if tau_max is not None:
        tau_max = _validate.nonnegative_int("tau_max", tau_max)
    if method not in SIM_METHODS:
        raise InvalidParameterError("method", method, f"one of {', '.join(SIM_METHODS)}")
    if method == "vectorized" and timing.cloud_time_s > 0:
        raise InvalidParameterError("method", method,
                                    "events (or auto) when cloud_time_s > 0: the queue couples "
                                    "the edges")
    limit = (50 * n_upd + k_edges) if max_events is None else \
        _validate.positive_int("max_events", max_events)
    speeds, links = _per_edge(seed, k_edges, timing)
    if method == "auto":
        method = "vectorized" if timing.cloud_time_s == 0 else "events"
    if method == "vectorized":
        cols = _vectorized(k_edges, n_upd, timing, seed, speeds, links, tau_max, limit)
    else:
        cols = _events(k_edges, n_upd, timing, seed, speeds, links, tau_max, limit)
    return Schedule(k_edges, *cols, speeds=speeds, link_speeds=links, tau_max=tau_max,
                    method=method)


def _too_stale(tau_max: int | None, applied: int, limit: int) -> InvalidParameterError:
    return InvalidParameterError(
        "tau_max", tau_max, f"large enough that uploads get applied (only {applied} applied "
        f"in {limit} uploads); raise it, or leave it unset")


_Cols = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
              np.ndarray, np.ndarray]


def _finish(edge: Any, upload: Any, pull: Any, applied_flags: Any, arrival: Any,
            done: Any) -> _Cols:
    edge_a = np.asarray(edge, dtype=np.int64)
    pull_a = np.asarray(pull, dtype=np.int64)
    app = np.asarray(applied_flags, dtype=bool)
    before = np.cumsum(app) - app  # updates applied before each event
    version = np.where(app, before + 1, -1).astype(np.int64)
    return (edge_a, np.asarray(upload, dtype=np.int64), pull_a, before - pull_a, app, version,
            np.asarray(arrival, dtype=np.float64), np.asarray(done, dtype=np.float64))


def _events(k_edges: int, n_upd: int, timing: TimingModel, seed: int, speeds: np.ndarray,
            links: np.ndarray, tau_max: int | None, limit: int) -> _Cols:
    """Heap over the K in-flight uploads; the cloud is one FIFO server."""
    c_mean = (timing.compute_time_s / speeds).tolist()
    l_mean = (timing.link_time_s / links).tolist()
    rngs = [_edge_rng(seed, k) for k in range(k_edges)]
    rows: list[np.ndarray] = [np.empty((0, 3))] * k_edges
    used = [0] * k_edges

    def row(k: int) -> np.ndarray:
        if used[k] == len(rows[k]):
            rows[k] = _jitter(rngs[k], _BLOCK, timing.jitter)
            used[k] = 0
        used[k] += 1
        return rows[k][used[k] - 1]

    heap: list[tuple[float, int]] = []
    last_down = [0.0] * k_edges
    for k in range(k_edges):
        j = row(k)
        heap.append((0.0 + ((0.0 + j[0] * c_mean[k]) + j[1] * l_mean[k]), k))
        last_down[k] = j[2] * l_mean[k]
    heapq.heapify(heap)
    pull = [0] * k_edges
    uploads = [0] * k_edges
    e_l: list[int] = []
    u_l: list[int] = []
    p_l: list[int] = []
    a_l: list[bool] = []
    arr_l: list[float] = []
    done_l: list[float] = []
    applied = 0
    free_at = 0.0
    cloud = timing.cloud_time_s
    while applied < n_upd:
        if len(e_l) >= limit:
            raise _too_stale(tau_max, applied, limit)
        t_arr, k = heapq.heappop(heap)
        done = max(t_arr, free_at) + cloud
        free_at = done
        ok = tau_max is None or applied - pull[k] <= tau_max
        e_l.append(k)
        u_l.append(uploads[k])
        p_l.append(pull[k])
        a_l.append(ok)
        arr_l.append(t_arr)
        done_l.append(done)
        applied += ok
        uploads[k] += 1
        pull[k] = applied
        j = row(k)
        inc = (last_down[k] + j[0] * c_mean[k]) + j[1] * l_mean[k]
        last_down[k] = j[2] * l_mean[k]
        heapq.heappush(heap, (done + inc, k))
    return _finish(e_l, u_l, p_l, a_l, arr_l, done_l)


def _vectorized(k_edges: int, n_upd: int, timing: TimingModel, seed: int, speeds: np.ndarray,
                links: np.ndarray, tau_max: int | None, limit: int) -> _Cols:
    """No queue: each edge's arrivals are a renewal process; FIFO order is one sort."""
    c_mean = timing.compute_time_s / speeds
    l_mean = timing.link_time_s / links
    rate = 1.0 / (c_mean + 2 * l_mean)
    need = n_upd
    horizon = need / rate.sum()
    while True:
        m = int(np.ceil(rate.max() * horizon * 1.25)) + 16
        jit = np.stack([_jitter(_edge_rng(seed, k), m, timing.jitter) for k in range(k_edges)])
        inc = jit[:, :, 0] * c_mean[:, None] + jit[:, :, 1] * l_mean[:, None]
        inc[:, 1:] = (jit[:, :-1, 2] * l_mean[:, None] + jit[:, 1:, 0] * c_mean[:, None]) \
            + jit[:, 1:, 1] * l_mean[:, None]
        arrival = np.cumsum(inc, axis=1)  # sequential sums, as the event path adds them
        flat_t = arrival.ravel()
        flat_e = np.repeat(np.arange(k_edges), m)
        order = np.lexsort((flat_e, flat_t))
        take = min(need, order.size)
        # every arrival before the take-th one must have been generated for every edge
        if flat_t[order[take - 1]] <= arrival[:, -1].min() and take == need:
            sel = order[:need]
            edge = flat_e[sel]
            upload = sel % m
            times = flat_t[sel]
            if tau_max is None:
                rank = np.empty(m * k_edges, dtype=np.int64)
                rank[sel] = np.arange(need)
                prev = sel - 1  # same edge, previous upload (valid where upload > 0)
                pull = np.where(upload > 0, rank[np.maximum(prev, 0)] + 1, 0)
                return _finish(edge, upload, pull, np.ones(need, bool), times, times)
            pulls, flags, reached = _sequential_drops(edge, upload, k_edges, tau_max, n_upd)
            if reached:
                n_ev = len(flags)
                return _finish(edge[:n_ev], upload[:n_ev], pulls, flags, times[:n_ev],
                               times[:n_ev])
            if need >= limit:
                raise _too_stale(tau_max, sum(flags), limit)
            need = min(2 * need, limit)
        horizon *= 2


def _sequential_drops(edge: np.ndarray, upload: np.ndarray, k_edges: int, tau_max: int,
                      n_upd: int) -> tuple[list[int], list[bool], bool]:
    """Pull versions and apply flags in FIFO order with drops, up to the n_upd-th apply.

    Returns (pull versions, apply flags, whether n_upd applies were reached).
    """
    pull_of = [0] * k_edges
    applied = 0
    pulls: list[int] = []
    flags: list[bool] = []
    for k in edge.tolist():
        p = pull_of[k]
        ok = applied - p <= tau_max
        pulls.append(p)
        flags.append(ok)
        applied += ok
        pull_of[k] = applied
        if applied == n_upd:
            return pulls, flags, True
    return pulls, flags, False
