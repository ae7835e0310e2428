"""Privacy settings shared by a Flower strategy and privkit's client mods.

One :class:`PrivacySettings` value describes the per-client mechanism of a run (Upcycled-FL's
output or objective perturbation, or DP-REC). A strategy writes it into every train message's
config (:meth:`PrivacySettings.to_config`); the client mods rebuild the same privkit mechanism
from it (:func:`mechanism_from_config`, through
:func:`privkit.mechanisms.perturbation.perturbation_mechanism`), with the client's |D_i| as the
server recorded it, so the mechanism a client applies is the one the server charges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from privkit import _validate
from privkit.errors import InvalidParameterError, PrivkitError
from privkit.flower import records as keys
from privkit.mechanisms.perturbation import SENSITIVITIES, perturbation_mechanism

__all__ = ["PrivacySettings", "mechanism_from_config", "settings_for",
           "needed_solver_settings", "MissingSettingError", "SOLVER_KEYS", "rec_num_groups",
           "CLIP_TARGETS", "PRIVACY_KINDS"]

#: Mechanisms a Flower run can use.
PRIVACY_KINDS = ("output", "objective", "rec")

#: What output perturbation clips: the released model (the paper) or its update w - w_bar.
CLIP_TARGETS = ("model", "update")


@dataclass(frozen=True)
class PrivacySettings:
    """The mechanism of a private run (fields as in :class:`fl_examples.core.privacy.PrivacyPlan`).

    Attributes:
        kind: ``output`` (clip + Gaussian noise of the uploaded model), ``objective`` (a
            linear noise term with density ~ exp(-alpha ||n||) in the local objective) or
            ``rec`` (DP-REC: the clipped update w - w_bar sent as a seed and candidate indices,
            :mod:`privkit.mechanisms.rec`; the server decodes it).
        l2_clip_norm: tau, the L2 clipping radius (parameter units).
        stddev: absolute noise standard deviation per coordinate (the paper's sigma).
        sensitivity: ``replace-one`` (2 tau, default), ``paper`` (tau/|D_i|) or
            ``strongly-convex`` (needs ``lipschitz_model`` and momentum 0).
        clip: ``model`` (clip the trained model, Upcycled-FL's output perturbation) or
            ``update`` (clip w - w_bar and release w_bar + clip(w - w_bar) + noise; w_bar is
            public, so the sensitivity is the same). An unchanged model is a zero update; its
            clip is the zero vector (no division by its norm).
        alpha, lipschitz, smoothness, rank: objective perturbation's rate and Thm C.2 constants.
        lipschitz_model: u1 of the per-example loss, for ``strongly-convex``.
        allow_unproven: run objective perturbation with an SGD solver (Thm C.2 assumes an
            exact minimiser), its epsilon marked NOT PROVEN.
        glm: the model is a generalised linear model (logistic regression).
        bits, groups: DP-REC's bits per index (K = 2**bits candidates per group) and grouping
            (``whole``, ``per-tensor``, ``per-parameter`` or ``chunks:N``); ``l2_clip_norm``
            and ``stddev`` are its C and sigma.
    """

    kind: str
    l2_clip_norm: float = 10.0
    stddev: float = 1.0
    sensitivity: str = "replace-one"
    clip: str = "model"
    alpha: float = 20.0
    lipschitz: float = 1.0
    smoothness: float = 0.25
    rank: int = 2
    lipschitz_model: float | None = None
    allow_unproven: bool = False
    glm: bool = True
    bits: int = 8
    groups: str = "per-tensor"

    def __post_init__(self) -> None:
        if self.kind not in PRIVACY_KINDS:
            raise InvalidParameterError("privacy", self.kind, "output, objective or rec")
        if self.sensitivity not in SENSITIVITIES:
            raise InvalidParameterError("sensitivity", self.sensitivity,
                                        f"one of {', '.join(SENSITIVITIES)}")
        if self.clip not in CLIP_TARGETS:
            raise InvalidParameterError("clip", self.clip, "model or update")
        for name in ("allow_unproven", "glm"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, getattr(self, name), "a bool")
        _validate.positive("l2_clip_norm", self.l2_clip_norm)
        _validate.positive("stddev", self.stddev)
        _validate.positive("alpha", self.alpha)
        if not (isinstance(self.bits, int) and not isinstance(self.bits, bool)
                and 1 <= self.bits <= 24):
            raise InvalidParameterError("bits", self.bits, "an integer in [1, 24]")
        rec_num_groups(self.groups, [1])  # validates the grouping

    def mechanism(self, client_size: int, *, proximal_mu: float = 0.0, batch_size: int = 32,
                  momentum: float = 0.0) -> Any:
        """The privkit mechanism of a client with ``client_size`` records (output or objective
        perturbation; :func:`privkit.mechanisms.perturbation.perturbation_mechanism`)."""
        if self.kind == "rec":
            raise InvalidParameterError("privacy", "rec", "output or objective for a mechanism "
                                        "built from settings (DP-REC encodes with rec.encode)")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("kind", "clip", "bits", "groups")}
        return perturbation_mechanism(self.kind, client_size, proximal_mu=float(proximal_mu),
                                      batch_size=int(batch_size), momentum=float(momentum),
                                      **fields)

    def to_config(self) -> dict[str, Any]:
        """Config entries (``privkit-privacy-<field>``); ``None`` fields are left out."""
        return {keys.PRIVACY_PREFIX + f.name.replace("_", "-"): getattr(self, f.name)
                for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PrivacySettings | None:
        """The settings a train message carries, or None if it carries none."""
        names = {f.name for f in dataclasses.fields(cls)}
        found = {}
        for key, value in config.items():
            if key.startswith(keys.PRIVACY_PREFIX):
                name = key[len(keys.PRIVACY_PREFIX):].replace("-", "_")
                if name not in names:
                    raise InvalidParameterError("config", key, "a known privacy setting")
                found[name] = value
        return cls(**found) if found else None


def rec_num_groups(groups: str, leaf_sizes: Sequence[int]) -> int:
    """M, the groups of a DP-REC message for arrays of these sizes (``privkit.rec/1`` rules)."""
    d = int(sum(leaf_sizes))
    if groups == "whole":
        return 1
    if groups == "per-tensor":
        return sum(1 for n in leaf_sizes if n)
    if groups == "per-parameter":
        return d
    if isinstance(groups, str) and groups.startswith("chunks:"):
        size = groups.split(":", 1)[1]
        if size.isdigit() and int(size) >= 1:
            return -(-d // int(size))
    raise InvalidParameterError("groups", groups,
                                "whole, per-tensor, per-parameter or chunks:N (N >= 1)")


#: The solver settings a mod may need: its constructor argument -> the train config key.
SOLVER_KEYS = {"client_size": keys.CLIENT_SIZE, "proximal_mu": keys.PROXIMAL_MU,
               "batch_size": keys.BATCH_SIZE, "momentum": keys.MOMENTUM}


class MissingSettingError(PrivkitError):
    """A mod needs a setting that neither its constructor nor the train message gave."""

    def __init__(self, name: str, where: str) -> None:
        self.name = name
        super().__init__(f"missing setting {name}: {where}")


def needed_solver_settings(settings: PrivacySettings) -> tuple[str, ...]:
    """The solver settings (keys of :data:`SOLVER_KEYS`) the mechanism of ``settings`` uses.

    Output perturbation with the default ``replace-one`` sensitivity (2 tau) and DP-REC need
    none; ``paper`` needs |D_i|; ``strongly-convex`` and objective perturbation need more."""
    if settings.kind == "objective":
        return ("client_size", "proximal_mu")
    if settings.kind == "output" and settings.sensitivity == "paper":
        return ("client_size",)
    if settings.kind == "output" and settings.sensitivity == "strongly-convex":
        return ("client_size", "proximal_mu", "batch_size", "momentum")
    return ()


def settings_for(config: Mapping[str, Any], own: PrivacySettings | None
                 ) -> PrivacySettings:
    """The settings to apply: the mod's own (``own``), else the train message's
    ``privkit-privacy-*`` entries; both given must agree.

    Raises:
        MissingSettingError: neither gives settings (names ``privacy``).
        PrivkitError: the message's settings differ from the mod's (names the field).
    """
    sent = PrivacySettings.from_config(config)
    if own is None:
        if sent is None:
            raise MissingSettingError(
                "privacy", "this client releases its model only through a privkit "
                "mechanism: give the mod its settings (e.g. OutputPerturbationMod("
                "l2_clip_norm=..., stddev=...)) or send privkit-privacy-* config entries "
                "(PrivacySettings.to_config)")
        return sent
    if sent is not None and sent != own:
        diff = next(f.name for f in dataclasses.fields(PrivacySettings)
                    if getattr(sent, f.name) != getattr(own, f.name))
        raise PrivkitError(f"the strategy's privacy setting {diff}={getattr(sent, diff)!r} "
                           f"differs from this mod's {getattr(own, diff)!r}")
    return own


def mechanism_from_config(config: Mapping[str, Any], *, settings: PrivacySettings | None = None,
                          solver: Mapping[str, Any] | None = None
                          ) -> tuple[PrivacySettings, Any]:
    """(settings, privkit mechanism) that a train message asks its client to apply.

    ``settings`` are the mod's own (else the message's, :func:`settings_for`); each solver
    setting the mechanism needs (:func:`needed_solver_settings`) comes from ``solver`` (the
    mod's constructor), else from the config key of :data:`SOLVER_KEYS`, e.g. the client's
    |D_i| as the server recorded it (``privkit-client-size``).

    Raises:
        MissingSettingError: a needed setting is given nowhere (one line naming it).
        PrivkitError: the message's and the mod's settings differ.
    """
    settings = settings_for(config, settings)
    solver = dict(solver or {})
    values: dict[str, Any] = {"client_size": 1, "proximal_mu": 0.0, "batch_size": 32,
                              "momentum": 0.0}  # unused by the mechanisms that need none
    for name in needed_solver_settings(settings):
        key = SOLVER_KEYS[name]
        if solver.get(name) is not None:
            values[name] = solver[name]
        elif key in config:
            values[name] = config[key]
        else:
            what = ("objective perturbation" if settings.kind == "objective" else
                    f"output perturbation with sensitivity {settings.sensitivity}")
            raise MissingSettingError(name, f"{what} needs it: pass {name}=... to the mod or "
                                      f"send the train config key {key!r}")
    mech = settings.mechanism(
        _validate.positive_int("client_size", values["client_size"]),
        proximal_mu=_validate.nonnegative("proximal_mu", values["proximal_mu"]),
        batch_size=_validate.positive_int("batch_size", values["batch_size"]),
        momentum=_validate.real("momentum", values["momentum"]))
    return settings, mech
