"""The coupling harness: run a private mode on D and on its neighbour D' with the same seeds
and check that every pre-noise release moves by at most the priced sensitivity, and only
through the target.

**What is checked.** A private mode releases a sequence of noisy values (a round's noisy sum of
clipped updates, a DP-SGD step's noisy gradient sum, a clipped model plus noise, ...). Its
privacy argument is adaptive composition: conditioned on the same past releases, the next
release's *pre-noise* value on D' differs from D's by at most the sensitivity the ledger
priced (C for a sum of contributions clipped to C under add/remove or zero-out, 2C under
replace-one). The harness measures exactly that, release by release:

- a *spy* on the mechanism's release point records the pre-noise value (before any division
  by a public constant) and, where it can, each contributor's clipped row and whether the
  target contributed (:meth:`Tap.record`);
- the *replay coupling* (:meth:`Tap.couple`): in the D run the spy returns the mechanism's
  own output and keeps a copy; in the D' run it computes D''s pre-noise value, records it and
  returns D's recorded output instead, so both runs see the same history (whatever the
  noise, the server state after a release is the same in both runs);
- public constants that the neighbour would change (a divisor q N, a cohort size, a count's
  noise scale, aggregation weights n_i / n) are the algorithm's settings, not data: D' uses
  D's (:meth:`Tap.public`, :func:`pin`). Which ones each entry pins is said in its docstring;
- :func:`compare` then asserts, per release: ``||pre_D' - pre_D||_2 <= bound (1 + 1e-9) +
  1e-5 max(1, bound, ||pre||)`` (float32 models), the same releases in the same order, equal
  pre-noise values where the target did not contribute, the same contributors apart from the
  target (as the relation allows) with equal rows, and for releases priced jointly (adaptive
  clipping's count and sum) ``sqrt(sum_i (diff_i / stddev_i)^2) <= 1 / z_joint``.

**Relations** (``docs/theory/accounting.md``): add/remove (``ADD_OR_REMOVE_ONE``, D' = D plus
one target client or record), zero-out (``REPLACE_SPECIAL``, the target keeps its place and
rounds, its contribution is null: the D' spy zeroes its row) and replace-one
(``REPLACE_ONE``, the target's data replaced by other data).

**Entries.** A mode joins by one :class:`Entry`: its name, relation, a hypothesis strategy of
small settings, a ``run(setting, tap)`` that builds D or D' (``tap.side``), installs the spies
and runs, and the code's own statement of its relation (``stated``, checked against
``relation``). :func:`check` runs an entry on one setting and returns a :class:`Report`.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_examples.core.data import FederatedDataset
from privkit.events.mechanisms import NeighboringRelation
from privkit.mechanisms import aggregate
from privkit.mechanisms.aggregate import AdaptiveClipping, ClientLevelGaussian
from privkit.mechanisms.bandmf import BandMF
from privkit.torch.clients import ClientsDpSgd

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE
ZERO_OUT = NeighboringRelation.REPLACE_SPECIAL
REPLACE_ONE = NeighboringRelation.REPLACE_ONE

D, D2 = "D", "D'"
#: Relative slack on a bound, and the absolute tolerance's scale (float32 models and sums).
REL_TOL, ABS_TOL = 1e-9, 1e-5


class CouplingError(Exception):
    """D' made a release (or a call) that D did not make: the runs are not coupled."""


# ------------------------------------------------------------------------------- values
def flat(x: Any) -> np.ndarray:
    """A tree (dict, list, tuple of tensors or arrays) as one float64 vector (dict order), a
    copy (the code may go on to change its tensors in place)."""
    if isinstance(x, dict):
        parts = [flat(v) for v in x.values()]
    elif isinstance(x, (list, tuple)):
        parts = [flat(v) for v in x]
    elif isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().reshape(-1).numpy().copy()
    else:
        return np.array(x, dtype=np.float64).reshape(-1)
    return np.concatenate(parts) if parts else np.zeros(0)


def rows_of(tree: Any, k: int) -> np.ndarray:
    """``(k, d)`` float64: row i is client i of a tree whose leaves lead with the client axis."""
    leaves = list(tree.values()) if isinstance(tree, dict) else [tree]
    parts = []
    for leaf in leaves:
        a = leaf.detach().to(torch.float64).cpu().numpy().copy() \
            if isinstance(leaf, torch.Tensor) else np.array(leaf, dtype=np.float64)
        parts.append(a.reshape(k, int(np.prod(a.shape[1:]))))
    return np.concatenate(parts, axis=1)


def zero_row(tree: dict[str, Any], j: int) -> dict[str, Any]:
    """A copy of ``tree`` with client row ``j`` of every leaf set to zero (a null update)."""
    out = {}
    for name, leaf in tree.items():
        v = leaf.clone() if isinstance(leaf, torch.Tensor) else np.array(leaf, copy=True)
        v[j] = 0
        out[name] = v
    return out


def _snapshot(x: Any) -> Any:
    return copy.deepcopy(x)


# ------------------------------------------------------------------------------- records
@dataclass
class Release:
    """One pre-noise release seen by a spy.

    Attributes:
        point: the release point (e.g. ``ClientLevelGaussian.__call__``).
        key: where in the run (round, step, client, ...), for messages.
        pre: the pre-noise value, float64, before division by public constants.
        bound: the priced sensitivity of this release, in ``pre``'s units.
        target: whether the target contributed (None: unknown to the spy).
        rows: each contributor's clipped contribution (None: not available).
        scale: the noise stddev of this release (for joint releases).
        group: releases of one group are priced as one Gaussian (adaptive clipping).
        joint_bound: 1 / z of that Gaussian.
    """

    point: str
    key: tuple[Any, ...]
    pre: np.ndarray
    bound: float
    target: bool | None = None
    rows: dict[Any, np.ndarray] | None = None
    scale: float | None = None
    group: Any = None
    joint_bound: float | None = None


@dataclass(frozen=True)
class Violation:
    """A broken coupling: ``kind`` is ``sensitivity`` (moved by more than the bound),
    ``leak`` (moved where the target did not contribute, or another contributor's row
    moved), ``membership`` (another contributor joined or left), ``count``/``order`` (the
    runs made different releases) or ``joint``/``schema`` (priced jointly / participation)."""

    kind: str
    index: int
    point: str
    key: tuple[Any, ...]
    measured: float
    bound: float
    detail: str = ""

    def __str__(self) -> str:
        return (f"{self.kind} at release {self.index} ({self.point} {self.key}): measured "
                f"{self.measured:.6g} vs bound {self.bound:.6g} {self.detail}").rstrip()


@dataclass
class Report:
    """The outcome of one entry on one setting."""

    entry: str
    setting: Any
    d: list[Release]
    d2: list[Release]
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def pairs(self) -> Iterator[tuple[Release, Release]]:
        return iter(zip(self.d, self.d2))

    def moved(self, *, target: bool | None = True) -> list[float]:
        """||pre_D' - pre_D|| of the releases where the target contributed (``target``)."""
        return [float(np.linalg.norm(b.pre - a.pre)) for a, b in self.pairs()
                if target is None or bool(a.target or b.target) == target]

    def max_ratio(self) -> float:
        """The largest moved / bound over all releases."""
        return max((float(np.linalg.norm(b.pre - a.pre)) / a.bound for a, b in self.pairs()
                    if a.bound > 0 and a.pre.shape == b.pre.shape), default=0.0)

    def sensitivity_violations(self) -> list[Violation]:
        return [v for v in self.violations if v.kind == "sensitivity"]

    def describe(self) -> str:
        head = (f"{self.entry} on {self.setting!r}: {len(self.d)} releases on D, "
                f"{len(self.d2)} on D'")
        return "\n".join([head, *(str(v) for v in self.violations[:12])])


class Tap:
    """One run's end of the coupling: what its spies recorded, and (D') the D run to replay.

    ``side`` is :data:`D` or :data:`D2`; ``ref`` is the D run's tap in the D' run. ``ctx`` is
    scratch space the spies of one entry share (the round's contributor ids, ...);
    ``target`` is the target's id in contributor rows (the entry's ``run`` sets it).
    """

    def __init__(self, side: str, ref: Tap | None = None) -> None:
        self.side, self.ref = side, ref
        self.target: Any = None
        self.releases: list[Release] = []
        self.outputs: dict[str, list[Any]] = defaultdict(list)
        self.constants: dict[Any, Any] = {}
        self.ctx: dict[str, Any] = {}
        self._pos: dict[str, int] = defaultdict(int)

    @property
    def replaying(self) -> bool:
        """True in the D' run (it returns D's outputs)."""
        return self.ref is not None

    def record(self, point: str, pre: Any, bound: float, *, key: tuple[Any, ...] = (),
               target: bool | None = None, rows: dict[Any, Any] | None = None,
               scale: float | None = None, group: Any = None,
               joint_bound: float | None = None) -> None:
        """Record one release's pre-noise value (see :class:`Release`)."""
        self.releases.append(Release(
            point, tuple(key), flat(pre), float(bound), target,
            None if rows is None else {k: flat(v) for k, v in rows.items()}, scale, group,
            joint_bound))

    def _next(self, channel: str) -> Any:
        i = self._pos[channel]
        self._pos[channel] += 1
        assert self.ref is not None
        got = self.ref.outputs[channel]
        if i >= len(got):
            raise CouplingError(f"{channel}: D' made call {i + 1}, D made {len(got)}")
        return got[i]

    def couple(self, channel: str, real: Callable[[], Any]) -> Any:
        """The replay coupling at one release point: ``real()`` runs in both runs (so every
        random stream is consumed alike); D keeps a copy of its output, D' returns that copy
        instead of its own."""
        out = real()
        if self.ref is None:
            self.outputs[channel].append(_snapshot(out))
            return out
        return _snapshot(self._next(channel))

    def merge(self, channel: str, own: Any, how: Callable[[Any, Any], Any]) -> Any:
        """Like :meth:`couple` for draws that D' extends: D' returns ``how(own, D's)``."""
        if self.ref is None:
            self.outputs[channel].append(_snapshot(own))
            return own
        return how(own, _snapshot(self._next(channel)))

    def public(self, key: Any, real: Callable[[], Any]) -> Any:
        """A public constant (a divisor, a cohort size): D's value in both runs."""
        if self.ref is None:
            value = real()
            self.constants.setdefault(key, value)
            return value
        return self.ref.constants[key] if key in self.ref.constants else real()


# ------------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class Entry:
    """One private mode in the harness.

    Attributes:
        name: test id.
        relation: the mode's stated relation (a :class:`NeighboringRelation`, or a function
            of the setting for modes whose relation is a setting).
        settings: hypothesis strategy of small settings (dicts).
        run: ``run(setting, tap)``: build D or D' (``tap.side``), install the spies, run.
        stated: ``stated(setting)``: the relation the code itself declares (its plan's or
            ledger's), which must be ``relation``; None where the code declares none.
        witness: a fixed setting in which the target contributes (the harness must see it
            move the pre-noise value: a check that the entry is not vacuous).
        extra: ``extra(setting, d, d2) -> list[Violation]``, entry-specific checks.
    """

    name: str
    relation: Any
    settings: Any
    run: Callable[[Any, Tap], None]
    stated: Callable[[Any], Any] | None = None
    witness: Any = None
    extra: Callable[[Any, Tap, Tap], list[Violation]] | None = None

    def relation_for(self, setting: Any) -> Any:
        return self.relation(setting) if callable(self.relation) else self.relation

    def __repr__(self) -> str:
        return self.name

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' failure reports
        p.text(self.name)


def check(entry: Entry, setting: Any) -> Report:
    """Run ``entry`` on D and on D' (replaying D's releases) and compare them."""
    d = Tap(D)
    entry.run(setting, d)
    d2 = Tap(D2, ref=d)
    problems: list[Violation] = []
    try:
        entry.run(setting, d2)
    except CouplingError as exc:
        problems.append(Violation("count", len(d2.releases), "run", (), len(d2.releases),
                                  len(d.releases), str(exc)))
    report = Report(entry.name, setting, d.releases, d2.releases)
    report.violations = problems + compare(d.releases, d2.releases,
                                           entry.relation_for(setting), d2.target)
    if entry.extra is not None:
        report.violations += entry.extra(setting, d, d2)
    return report


def assert_coupled(entry: Entry, setting: Any) -> Report:
    """:func:`check`, asserting no violation and at least one release; the relation the code
    states must be the entry's."""
    if entry.stated is not None:
        assert entry.stated(setting) == entry.relation_for(setting), (
            f"{entry.name}: the code states {entry.stated(setting)}, the entry checks "
            f"{entry.relation_for(setting)}")
    report = check(entry, setting)
    assert report.d, f"{entry.name}: no release was seen (is the spy installed?)"
    assert report.ok, report.describe()
    return report


def _tol(bound: float, *vecs: np.ndarray) -> float:
    big = max([1.0, bound, *(float(np.linalg.norm(v)) for v in vecs)])
    return ABS_TOL * big


def compare(d: list[Release], d2: list[Release], relation: Any, target: Any = None
            ) -> list[Violation]:
    """The per-release checks of the module docstring (D is the reference; ``target`` keys
    the target's rows)."""
    out: list[Violation] = []
    if len(d) != len(d2):
        out.append(Violation("count", min(len(d), len(d2)), "run", (), len(d2), len(d),
                             "(releases on D' vs on D)"))
    joint: dict[Any, list[float]] = defaultdict(list)
    joint_bound: dict[Any, float] = {}
    for i, (a, b) in enumerate(zip(d, d2)):
        if (a.point, a.key) != (b.point, b.key) or a.pre.shape != b.pre.shape:
            out.append(Violation("order", i, a.point, a.key, 0.0, 0.0,
                                 f"D' made {b.point} {b.key} {b.pre.shape} instead"))
            break
        diff = float(np.linalg.norm(b.pre - a.pre))
        tol = _tol(a.bound, a.pre, b.pre)
        if diff > a.bound * (1 + REL_TOL) + tol:
            out.append(Violation("sensitivity", i, a.point, a.key, diff, a.bound))
        contributed = None if a.target is None and b.target is None \
            else bool(a.target or b.target)
        if contributed is False and diff > tol:
            out.append(Violation("leak", i, a.point, a.key, diff, tol,
                                 "(the target did not contribute)"))
        if a.rows is not None and b.rows is not None:
            out += _rows(i, a, b, relation, target)
        if a.group is not None and a.scale:
            joint[(a.group,)].append((diff / a.scale) ** 2)
            joint_bound[(a.group,)] = float(a.joint_bound or math.inf)
    for g, parts in joint.items():
        value = math.sqrt(sum(parts))
        if value > joint_bound[g] * (1 + 1e-6) + ABS_TOL:
            out.append(Violation("joint", -1, "joint release", g, value, joint_bound[g],
                                 "(the pair scaled by each part's noise vs 1 / z_eff)"))
    return out


def _rows(i: int, a: Release, b: Release, relation: Any, target: Any) -> list[Violation]:
    """Contributors other than the target: the same ones, with the same rows."""
    assert a.rows is not None and b.rows is not None
    ids_a, ids_b = set(a.rows), set(b.rows)
    out: list[Violation] = []
    others_a, others_b = ids_a - {target}, ids_b - {target}
    if relation == ADD_REMOVE:
        same = others_a == others_b
    else:  # zero-out and replace-one keep every contributor, the target too
        same = ids_a == ids_b
    if not same:
        out.append(Violation("membership", i, a.point, a.key, float(len(ids_a ^ ids_b)), 0.0,
                             f"(contributors on D {sorted(ids_a)}, on D' {sorted(ids_b)})"))
    for k in sorted(others_a & others_b, key=repr):
        diff = float(np.linalg.norm(b.rows[k] - a.rows[k]))
        tol = _tol(0.0, a.rows[k], b.rows[k])
        if diff > tol:
            out.append(Violation("leak", i, a.point, a.key, diff, tol,
                                 f"(contributor {k!r}'s row moved)"))
    return out


# ------------------------------------------------------------------------------- spies
def pin(mp: pytest.MonkeyPatch, tap: Tap, owner: Any, name: str) -> None:
    """Make ``owner.name`` (a property or a method) a public constant: D' uses D's value
    (per argument tuple for a method)."""
    attr = inspect.getattr_static(owner, name)
    label = getattr(owner, "__name__", str(owner))
    if isinstance(attr, property):
        fget = attr.fget
        assert fget is not None
        mp.setattr(owner, name, property(
            lambda self: tap.public((label, name), lambda: fget(self))))
        return
    real = getattr(owner, name)
    if inspect.isclass(owner):
        def method(self: Any, *args: Any) -> Any:
            return tap.public((label, name, *args), lambda: real(self, *args))
        mp.setattr(owner, name, method)
    else:  # a module-level function
        def function(*args: Any, **kw: Any) -> Any:
            return tap.public((label, name), lambda: real(*args, **kw))
        mp.setattr(owner, name, function)


def spy_client_sum(mp: pytest.MonkeyPatch, tap: Tap, cls: Any, *, ids: Callable[[], list],
                   target: Any, bound: Callable[[Any], float], zero_target: bool = False,
                   group: Callable[[], Any] | None = None,
                   joint: Callable[[], float] | None = None) -> None:
    """Spy on a client-level sum's release point, :class:`ClientLevelGaussian` or
    :class:`BandMF` ``__call__``: the pre-noise value is the (weighted) sum of the rows the
    mechanism's own ``clip`` gives, in float64; ``ids()`` names the rows (the round's
    contributors, in row order); ``bound(mechanism)`` is the priced sensitivity. With
    ``zero_target`` the D' spy replaces the target's row by zeros first (zero-out). The
    release (the noisy sum, and for BandMF the next noise state) is coupled."""
    real = cls.__call__
    point = f"{cls.__name__}.__call__"

    def observe(self: Any, updates: Any, weights: Any) -> Any:
        k = next(iter(updates.values())).shape[0]
        now = list(ids())
        assert len(now) == k, f"harness: {len(now)} ids for {k} rows"
        if zero_target and tap.replaying and target in now:
            updates = zero_row(updates, now.index(target))
        clipper = self if isinstance(self, ClientLevelGaussian) else ClientLevelGaussian(
            self.l2_clip_norm, self.noise_multiplier, nonfinite=self.nonfinite)
        r = rows_of(clipper.clip(updates) if k else updates, k)
        if weights is not None:
            r = r * flat(weights)[:, None]
        tap.record(point, r.sum(0), bound(self), key=(tap.ctx.get("round"),),
                   target=target in now, rows=dict(zip(now, r)),
                   scale=self.stddev, group=group() if group else None,
                   joint_bound=joint() if joint else None)
        return updates

    if cls is BandMF:
        def spy(self: Any, updates: Any, state: Any, *, rng: Any, weights: Any = None) -> Any:
            updates = observe(self, updates, weights)
            return tap.couple(point, lambda: real(self, updates, state, rng=rng,
                                                  weights=weights))
    else:
        def spy(self: Any, updates: Any, *, rng: Any, weights: Any = None) -> Any:  # type: ignore[misc]
            updates = observe(self, updates, weights)
            return tap.couple(point, lambda: real(self, updates, rng=rng, weights=weights))
    mp.setattr(cls, "__call__", spy)


def _zero_noise(tree: Any, stddev: float, *, rng: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zero_noise(v, stddev, rng=rng) for k, v in tree.items()}
    return np.zeros_like(np.asarray(tree, dtype=np.float64))


def spy_adaptive_count(mp: pytest.MonkeyPatch, tap: Tap, *, ids: Callable[[], list],
                       target: Any, group: Callable[[], Any], joint: Callable[[], float]
                       ) -> None:
    """Spy on :meth:`AdaptiveClipping.update`, the count release of adaptive clipping.

    The pre-noise value is the centred count ``sum_i (1[||Delta_i|| <= C] - 1/2)``, read off
    the code itself: the update run once with its noise replaced by zero gives
    ``C' = C exp(-eta (count / m + 1/2 - gamma))``, so ``count = m (log(C / C') / eta + gamma
    - 1/2)`` (each client's row the same on its own norm). Bound 1/2; noise
    ``count_stddev``; grouped with the round's sum (``group``, ``joint`` = 1 / z_eff). The
    released clip norm is coupled."""
    real = AdaptiveClipping.update

    def centred(self: Any, clip: float, norms: np.ndarray, m: float, rng: Any) -> float:
        with pytest.MonkeyPatch.context() as quiet:
            quiet.setattr(aggregate, "gaussian_noise", _zero_noise)
            new = real(self, clip, norms, expected_clients=m, rng=rng)
        return m * (math.log(clip / new) / float(self.learning_rate)
                    + float(self.target_quantile) - 0.5)

    def spy(self: Any, clip: float, norms: Any, *, expected_clients: float, rng: Any) -> float:
        n = flat(norms)
        now = list(ids())
        assert len(now) == len(n)
        rows = {c: [centred(self, clip, n[j:j + 1], expected_clients, rng)]
                for j, c in enumerate(now)}
        tap.record("AdaptiveClipping.update", [centred(self, clip, n, expected_clients, rng)],
                   AdaptiveClipping.COUNT_SENSITIVITY, key=(tap.ctx.get("round"),),
                   target=target in now, rows=rows, scale=float(self.count_stddev),
                   group=group(), joint_bound=joint())
        return tap.couple("AdaptiveClipping.update", lambda: real(
            self, clip, norms, expected_clients=expected_clients, rng=rng))

    mp.setattr(AdaptiveClipping, "update", spy)


def spy_clients_dpsgd(mp: pytest.MonkeyPatch, tap: Tap, *, target_key: int, target_row: int,
                      bound: float) -> None:
    """Spy on :class:`~privkit.torch.ClientsDpSgd`'s per-step release: each client's clipped
    per-example gradient sum (``_clipped``, before the noise of ``_draws`` and the division
    by the public ``q_i n_i``), one release per client and step, bound C.

    D' is D with one record appended to client ``target_key`` (its row ``target_row``).
    Coins: a client's Poisson uniforms come from its own stream, so in D' the target's
    client draws one more uniform and its later coins shift; the coupling gives every record
    of D its D coin (D's ``take``) and the target record the coin D' drew for it. Noise: D's.
    The clipped sums are coupled (D' steps with D's noisy gradient)."""
    real_run, real_draws, real_clipped = ClientsDpSgd.run, ClientsDpSgd._draws, \
        ClientsDpSgd._clipped

    def run(self: Any, params: Any, data: Any, *, client_keys: Any, **kw: Any) -> Any:
        tap.ctx["dpsgd_keys"] = [int(k) for k in client_keys]
        tap.ctx["dpsgd_call"] = tap.ctx.get("dpsgd_call", -1) + 1
        tap.ctx["dpsgd_step"] = -1
        return real_run(self, params, data, client_keys=client_keys, **kw)

    def draws(self: Any, rng: Any, gens: Any, active: Any, c: Any, width: int, d: int,
              stddev: float) -> Any:
        keys = tap.ctx["dpsgd_keys"]
        kt = keys.index(target_key) if target_key in keys else None
        tap.ctx["dpsgd_step"] += 1

        def how(own: Any, ref: Any) -> Any:
            (t_own, _), (t_ref, z_ref) = own, ref
            t = torch.zeros_like(t_own)
            t[:, :t_ref.shape[1]] = t_ref
            if kt is not None and target_row < t.shape[1]:
                t[kt, target_row] = t_own[kt, target_row]
            return t, z_ref

        take, z = tap.merge("ClientsDpSgd._draws",
                            real_draws(self, rng, gens, active, c, width, d, stddev), how)
        tap.ctx["dpsgd_take"] = take
        return take, z

    def clipped(self: Any, theta: Any, c: Any, x: Any, y: Any, w: Any, where: Any) -> Any:
        out = real_clipped(self, theta, c, x, y, w, where)
        keys, take = tap.ctx["dpsgd_keys"], tap.ctx["dpsgd_take"]
        for i, key in enumerate(keys):
            hit = key == target_key and target_row < take.shape[1] \
                and bool(take[i, target_row])
            tap.record("ClientsDpSgd step", out[i], bound, target=hit,
                       key=(tap.ctx["dpsgd_call"], tap.ctx["dpsgd_step"], key))
        return tap.couple("ClientsDpSgd._clipped", lambda: out)

    mp.setattr(ClientsDpSgd, "run", run)
    mp.setattr(ClientsDpSgd, "_draws", draws)
    mp.setattr(ClientsDpSgd, "_clipped", clipped)


# ------------------------------------------------------------------------------- data
def toy_clients(seed: int, sizes: list[int], *, features: int = 4, classes: int = 2,
                scale: float = 1.0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Small client data sets of a shared linear rule (float32 features, int labels)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(features, classes))
    out = []
    for n in sizes:
        x = (scale * rng.normal(size=(n, features))).astype(np.float32)
        out.append((x, np.argmax(x @ w + 0.3 * rng.normal(size=(n, classes)), axis=1)))
    return out


def opposite(client: tuple[np.ndarray, np.ndarray], classes: int = 2
             ) -> tuple[np.ndarray, np.ndarray]:
    """Other data for a client: features negated, labels shifted (its update turns away)."""
    x, y = client
    return (-x).astype(np.float32), (np.asarray(y) + 1) % classes


def with_record(client: tuple[np.ndarray, np.ndarray], seed: int, classes: int = 2
                ) -> tuple[np.ndarray, np.ndarray]:
    """The client with one extra record appended (the target record, last row)."""
    x, y = client
    rng = np.random.default_rng(seed + 7919)
    extra = (3.0 * rng.normal(size=(1, x.shape[1]))).astype(np.float32)
    return np.vstack([x, extra]), np.concatenate([y, [int(rng.integers(classes))]])


def replaced_record(client: tuple[np.ndarray, np.ndarray], j: int, classes: int = 2
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The client with record ``j`` replaced by another (features negated and scaled,
    label shifted)."""
    x, y = np.array(client[0], copy=True), np.array(client[1], copy=True)
    x[j] = -3.0 * x[j]
    y[j] = (y[j] + 1) % classes
    return x, y


def federated(clients: list[tuple[np.ndarray, np.ndarray]], *, features: int = 4,
              classes: int = 2, weights: Any = None) -> FederatedDataset:
    """A :class:`FederatedDataset` of ``clients`` (ids ``c0``, ``c1``, ...; a public held-out
    set). ``weights``: aggregation weights to report instead of n_i / n (D's, pinned in D')."""
    rng = np.random.default_rng(12345)
    hx = rng.normal(size=(16, features)).astype(np.float32)
    cls: Any = FederatedDataset
    if weights is not None:
        fixed = np.asarray(weights, dtype=np.float64)
        cls = type("PinnedWeights", (FederatedDataset,),
                   {"weights": property(lambda self: fixed)})
    return cls(tuple(f"c{i}" for i in range(len(clients))), [x for x, _ in clients],
               [y for _, y in clients], [x[:1] for x, _ in clients],
               [y[:1] for _, y in clients], features, classes, {"recipe": "coupling"},
               hx, rng.integers(0, classes, 16))


# ------------------------------------------------------------------------------- tests
#: Small hypothesis-drawn settings, derandomised: the same draws on every run.
FAST = settings(max_examples=8, deadline=None, derandomize=True)


def coupling_tests(entries: list[Entry], *, witness_moves: float = 1e-3
                   ) -> tuple[Callable[..., None], Callable[..., None]]:
    """The two tests every entry runs, bound to ``entries`` (a module assigns them to
    ``test_coupling, test_witness_sees_the_target``): the coupling holds on drawn settings;
    and, not vacuous, in the entry's pinned witness setting the target moves a release by
    more than ``witness_moves``."""

    @pytest.mark.parametrize("entry", entries, ids=lambda e: e.name)
    @FAST
    @given(data=st.data())
    def test_coupling(entry: Entry, data: Any) -> None:
        assert_coupled(entry, data.draw(entry.settings, label="setting"))

    @pytest.mark.parametrize("entry", entries, ids=lambda e: e.name)
    def test_witness_sees_the_target(entry: Entry) -> None:
        report = assert_coupled(entry, entry.witness)
        assert max(report.moved(), default=0.0) > witness_moves, report.describe()

    return test_coupling, test_witness_sees_the_target
