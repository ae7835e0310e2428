"""Client mods: privkit's output and objective perturbation, DP-REC and record-level DP-SGD
around any Flower ClientApp.

The mods act on train messages only and fail closed: without privacy settings, or with
settings of another kind than the mod's, a train message gets an error reply (one line naming
what is missing) and the client's model never leaves.

Where the settings come from:

- **Any strategy** (stock Flower ``FedAvg``, ``FedProx``, ...): give them to the mod,
  ``OutputPerturbationMod(l2_clip_norm=10.0, noise_multiplier=0.5)``,
  ``ObjectivePerturbationMod(alpha=20.0, client_size=600, proximal_mu=1.0)``,
  ``RecMod(l2_clip_norm=1.0, stddev=0.5, bits=8)`` (or ``settings=PrivacySettings(...)``),
  ``DpSgdMod(l2_clip_norm=1.0, noise_multiplier=1.1, batch_size=32)`` (constructor only).
  Nothing is charged on a ledger then: the stock strategy keeps none (price the releases with
  :func:`privkit.epsilon` of the mechanism's event, or use privkit's strategy).
- **privkit's strategies** send them in every train message (``privkit-privacy-<field>``
  entries, :meth:`PrivacySettings.to_config`): build the mod without settings. A mod with its
  own settings refuses a message whose settings differ.
- The solver settings a mechanism needs (|D_i| for ``paper`` and ``strongly-convex``
  sensitivity and for objective perturbation, ...; see
  :func:`~fl_examples.flower.privacy.needed_solver_settings`) come from the mod's
  constructor (``client_size``, ``proximal_mu``, ``batch_size``, ``momentum``), else from
  the train config keys ``privkit-client-size``, ``proximal-mu``, ``batch-size``,
  ``momentum``. Output perturbation with the default ``replace-one`` sensitivity and DP-REC
  need none.

The reply echoes the mechanism's parameter (noise multiplier, or the step epsilon) for
privkit's strategy to check against what its ledger charged.

Noise comes from an explicit generator, never a global one: by default privkit's
:class:`~privkit.SecureRandom` (OS entropy, nothing to seed); ``noise_seed`` gives the stream
``noise/<client>`` of round ``server-round`` in a :class:`~privkit.seeds.SeedTree` for
reproducible experiments only (whoever knows the seed can subtract the noise).

Unlike Flower's ``LocalDpMod``, clipping an unchanged model (a zero update with
``clip="update"``) is well defined: privkit's ``clip_l2`` leaves a vector inside the ball as is
and never divides by its norm.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord
from flwr.clientapp.typing import ClientAppCallable

from privkit import _validate
from privkit._rng import SecureRandom
from privkit.errors import InvalidParameterError, PrivkitError
from privkit.events import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from privkit.flower import records as keys
from privkit.flower.settings import (
    MissingSettingError,
    PrivacySettings,
    mechanism_from_config,
    settings_for,
)
from privkit.seeds import SeedTree

__all__ = ["OutputPerturbationMod", "ObjectivePerturbationMod", "RecMod", "DpSgdMod",
           "DpSgdRequest", "dpsgd_request", "ClientSideClippingMod", "MOD_FAILED"]

#: Flower's error code for a mod whose precondition failed (``ErrorCode.MOD_FAILED_PRECONDITION``).
MOD_FAILED = 6


def _error(msg: Message, mod: str, reason: str) -> Message:
    return Message(Error(code=MOD_FAILED, reason=f"{mod}: {reason}"), reply_to=msg)


def _is_train(msg: Message) -> bool:
    return msg.metadata.message_type.split(".")[0] == "train"


def _train_config(msg: Message) -> Any:
    """The train message's single ConfigRecord (an empty one if it has none)."""
    records = msg.content.config_records
    if len(records) > 1:
        raise PrivkitError("the train message must carry at most one ConfigRecord")
    return next(iter(records.values())) if records else {}


def _seeded(noise_seed: int, config: Any) -> Any:
    """Stream ``noise/<client>`` of round ``server-round`` of the seed tree (experiments)."""
    for key in (keys.CLIENT, keys.SERVER_ROUND):
        if key not in config:
            raise MissingSettingError(key, f"noise_seed needs the train config key {key!r}")
    client = int(config[keys.CLIENT])
    return SeedTree(noise_seed).numpy(int(config[keys.SERVER_ROUND]), f"noise/{client}")


class _PrivacyMod:
    """Shared plumbing: the mod's own settings, the noise generator, reading the message.

    Args:
        settings: the mechanism (a :class:`PrivacySettings` of this mod's kind), or give its
            fields as keywords instead (``l2_clip_norm``, ``stddev``, ``sensitivity``, ...;
            ``noise_multiplier`` for DP-REC, stddev = z C; output perturbation takes
            ``stddev``: before privkit-fl 0.2 its ``noise_multiplier`` meant stddev / (2 tau),
            and a number given that way is refused rather than read as stddev / tau, which
            would halve the noise). None and no keywords: the
            settings come from each train message (``privkit-privacy-*``, sent by privkit's
            strategies).
        noise_seed: reproducible noise (experiments only), see the module docstring.
        client_size, proximal_mu, batch_size, momentum: the solver settings some mechanisms
            need (``needed_solver_settings``); each falls back to its train config key
            (``privkit-client-size``, ``proximal-mu``, ``batch-size``, ``momentum``).
    """

    kind = ""
    #: The fields a mod built from keywords must be given (no silent defaults).
    required: tuple[str, ...] = ()

    def __init__(self, settings: PrivacySettings | None = None, *, noise_seed: int | None = None,
                 client_size: int | None = None, proximal_mu: float | None = None,
                 batch_size: int | None = None, momentum: float | None = None,
                 **fields: Any) -> None:
        self.noise_seed = None if noise_seed is None else _validate.nonnegative_int(
            "noise_seed", noise_seed)
        if settings is not None and fields:
            raise InvalidParameterError("settings", settings,
                                        "given alone, or its fields as keywords, not both")
        if fields:
            settings = self._from_fields(dict(fields))
        if settings is not None:
            if not isinstance(settings, PrivacySettings):
                raise InvalidParameterError("settings", settings, "a PrivacySettings")
            if settings.kind != self.kind:
                raise InvalidParameterError("settings", settings.kind,
                                            f"{self.kind} (this is {self.name})")
        self.settings = settings
        self.solver = {"client_size": None if client_size is None else
                       _validate.positive_int("client_size", client_size),
                       "proximal_mu": None if proximal_mu is None else
                       _validate.nonnegative("proximal_mu", proximal_mu),
                       "batch_size": None if batch_size is None else
                       _validate.positive_int("batch_size", batch_size),
                       "momentum": None if momentum is None else
                       _validate.real("momentum", momentum)}

    def _from_fields(self, fields: dict[str, Any]) -> PrivacySettings:
        z = fields.pop("noise_multiplier", None)
        if z is not None:
            if "stddev" in fields:
                raise InvalidParameterError("noise_multiplier", z, "given without stddev")
            if self.kind == "output":
                tau = fields.get("l2_clip_norm")
                old = (f" (the noise a noise_multiplier of {z!r} drew before 0.2: stddev="
                       f"{2 * z * tau!r})" if isinstance(tau, (int, float)) and isinstance(
                           z, (int, float)) else "")
                raise InvalidParameterError(
                    "noise_multiplier", z, "replaced by stddev for output perturbation: since "
                    "privkit-fl 0.2 a noise multiplier is stddev / C under every relation "
                    "(it meant stddev / (2 tau) here), so give the noise itself" + old)
            if self.kind != "rec":
                raise InvalidParameterError("noise_multiplier", z, "used with DP-REC; give "
                                            "stddev")
            tau = _validate.positive("l2_clip_norm", fields.get("l2_clip_norm", float("nan")))
            fields["stddev"] = _validate.positive("noise_multiplier", z) * tau
        for name in self.required:
            if name not in fields:
                raise MissingSettingError(name, f"{self.name} built from keywords needs "
                                          f"{name}=...")
        names = {f.name for f in dataclasses.fields(PrivacySettings)} - {"kind"}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise InvalidParameterError(unknown[0], fields[unknown[0]],
                                        f"a PrivacySettings field ({', '.join(sorted(names))})")
        return PrivacySettings(self.kind, **fields)

    @property
    def name(self) -> str:
        return type(self).__name__

    def rng(self, config: Any, context: Context) -> Any:
        """The noise generator of this client and round."""
        return SecureRandom() if self.noise_seed is None else _seeded(self.noise_seed, config)

    def config(self, msg: Message) -> Any:
        """The train message's single ConfigRecord (an empty one if it has none)."""
        return _train_config(msg)

    def mechanism(self, msg: Message) -> tuple[Any, Any, Any]:
        """(config, settings, mechanism) of a train message; raises PrivkitError if unusable."""
        config = self.config(msg)
        settings, mech = mechanism_from_config(config, settings=self.settings,
                                               solver=self.solver)
        if settings.kind != self.kind:
            raise PrivkitError(f"the strategy asks for {settings.kind} perturbation, this "
                               f"client is set up for {self.kind} perturbation")
        return config, settings, mech


class OutputPerturbationMod(_PrivacyMod):
    """Clip the returned model (or its update) and add Gaussian noise (Upcycled-FL, Thm C.1).

    Released: ``xi(w) + n`` (``clip="model"``) or ``w_bar + xi(w - w_bar) + n``
    (``clip="update"``), with ``xi`` the L2 clip to tau and ``n ~ N(0, stddev^2 I)`` over every
    array of the reply's single ArrayRecord. The reply's metrics gain ``privkit-noise-multiplier``.

    Examples:
        With any strategy (stock ``FedAvg``): ``ClientApp(mods=[OutputPerturbationMod(
        l2_clip_norm=10.0, noise_multiplier=0.5)])``. With privkit's strategy given
        ``privacy=PrivacySettings("output", l2_clip_norm=10, stddev=0.8)`` (which also charges
        its ledger): ``OutputPerturbationMod()`` reads the settings from each train message.
    """

    kind = "output"
    required = ("l2_clip_norm", "stddev")

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg):
            return call_next(msg, context)
        try:
            config, settings, mech = self.mechanism(msg)
            sent = _sent_arrays(msg)
        except (PrivkitError, KeyError, TypeError, ValueError) as exc:
            return _error(msg, self.name, str(exc))
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        try:
            name, trained = _trained_like(reply, sent)
            rng = self.rng(config, context)
            if settings.clip == "update":
                delta = {k: trained[k] - sent[k] for k in sent}
                noisy = mech(delta, rng=rng)
                released = {k: (sent[k] + noisy[k]).astype(sent[k].dtype) for k in sent}
            else:
                released = mech(trained, rng=rng)
        except (PrivkitError, ValueError) as exc:
            return _error(msg, self.name, str(exc))
        reply.content[name] = keys.to_record({k: np.asarray(v) for k, v in released.items()})
        _echo(reply, keys.NOISE_MULTIPLIER, float(mech.noise_multiplier))
        return reply


class ObjectivePerturbationMod(_PrivacyMod):
    """Draw objective perturbation's linear term n and hand it to the local solver (Thm C.2).

    Before training, n with density ~ exp(-alpha ||n||_2) over all model coordinates is added
    to the train message as an ArrayRecord ``privkit-linear-term`` (same names and shapes as
    the model); the ClientApp must add n to every gradient of the round (``local_update(...,
    linear_term=n)``) and say so with the metric ``privkit-linear-term-used = 1``, else the
    mod replaces the reply with an error. The reply's metrics gain ``privkit-step-epsilon``.
    """

    kind = "objective"
    required = ("alpha",)

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg):
            return call_next(msg, context)
        try:
            config, _, mech = self.mechanism(msg)
            like = _sent_arrays(msg)
            term = mech.linear_term(like, rng=self.rng(config, context))
        except (PrivkitError, KeyError, TypeError, ValueError) as exc:
            return _error(msg, self.name, str(exc))
        msg.content[keys.LINEAR_TERM] = keys.to_record(term)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        metrics = list(reply.content.metric_records.values())
        if len(metrics) != 1 or metrics[0].get(keys.LINEAR_TERM_USED) != 1:
            return _error(msg, self.name, "the ClientApp did not confirm that it trained with "
                          f"the linear term (metric {keys.LINEAR_TERM_USED} = 1); its model "
                          "is not released")
        _echo(reply, keys.STEP_EPSILON, float(mech.step_epsilon))
        return reply


class RecMod(_PrivacyMod):
    """Send the update as a DP-REC message: a seed and candidate indices (DP-REC, Alg. 1-4).

    The update ``u = w - w_bar`` (float64) is clipped to C and encoded with
    :func:`privkit.mechanisms.rec.encode` (K = 2**bits candidates per group); the reply's single
    ArrayRecord is replaced by one uint8 array ``privkit-rec-message`` holding the
    ``privkit.rec/1`` bytes, which the strategy decodes (``w_bar + decode(...)``) and checks
    against the event it charged. The reply's metrics gain ``privkit-uplink-bits`` (seed plus
    indices). The candidate seed and the selection randomness come from the OS CSPRNG unless
    ``noise_seed`` is set (then both come from the client's ``noise/<client>`` stream).
    """

    kind = "rec"
    required = ("l2_clip_norm", "stddev")

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        from privkit.mechanisms.rec import encode

        if not _is_train(msg):
            return call_next(msg, context)
        try:
            config = self.config(msg)
            settings = settings_for(config, self.settings)
            if settings.kind != self.kind:
                raise PrivkitError(f"the strategy sent {settings.kind}; this client sends its "
                                   "update only through DP-REC (privacy kind rec)")
            sent = _sent_arrays(msg)
        except (PrivkitError, KeyError, TypeError, ValueError) as exc:
            return _error(msg, self.name, str(exc))
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        try:
            name, trained = _trained_like(reply, sent)
            update = {k: trained[k].astype(np.float64) - sent[k].astype(np.float64)
                      for k in sent}
            rng = self.rng(config, context)
            seed = None if self.noise_seed is None else rng.bytes(16)
            message = encode(update, l2_clip_norm=settings.l2_clip_norm, stddev=settings.stddev,
                             bits=settings.bits, groups=settings.groups, seed=seed, rng=rng)
        except (PrivkitError, ValueError) as exc:
            return _error(msg, self.name, str(exc))
        payload = np.frombuffer(message.to_bytes(), dtype=np.uint8).copy()
        reply.content[name] = ArrayRecord({keys.REC_MESSAGE: Array(payload)})
        _echo(reply, keys.UPLINK_BITS, float(message.size_bits()))
        return reply


@dataclasses.dataclass(frozen=True)
class DpSgdRequest:
    """What :class:`DpSgdMod` asks a ClientApp to train with (one round).

    Attributes:
        l2_clip_norm: C, each example's gradient bound, > 0.
        noise_multiplier: z, the noise stddev over C on each step's clipped sum, > 0.
        batch_size: b, the expected Poisson minibatch size (rate ``min(1, b / n_i)``), >= 1.
        noise_seed: the 63-bit seed of the round's Poisson draws and noise (from the OS
            CSPRNG unless the mod was given ``noise_seed``).
    """

    l2_clip_norm: float
    noise_multiplier: float
    batch_size: int
    noise_seed: int = 0

    def __post_init__(self) -> None:
        _validate.positive("l2_clip_norm", self.l2_clip_norm)
        _validate.positive("noise_multiplier", self.noise_multiplier)
        _validate.positive_int("batch_size", self.batch_size)
        _validate.nonnegative_int("noise_seed", self.noise_seed)

    def sampling_rate(self, client_size: int) -> float:
        """q_i = min(1, b / n_i) of a client with ``client_size`` records."""
        return min(1.0, self.batch_size / _validate.positive_int("client_size", client_size))

    def round_event(self, client_size: int, steps: int) -> Any:
        """The event of a client with ``client_size`` records that ran ``steps`` steps
        (add or remove one record)."""
        q = self.sampling_rate(client_size)
        inner: Any = GaussianDpEvent(float(self.noise_multiplier))
        if q < 1:
            inner = PoissonSampledDpEvent(q, inner)
        return SelfComposedDpEvent(inner, _validate.nonnegative_int("steps", steps))


class DpSgdMod:
    """Ask the ClientApp to train with record-level DP-SGD and release only if it did.

    A mod cannot change how a ClientApp trains, so this one works like
    :class:`ObjectivePerturbationMod`: before training it adds the ConfigRecord
    ``privkit-dpsgd`` (``l2-clip-norm``, ``noise-multiplier``, ``batch-size`` and a 63-bit
    ``noise-seed``) to the train message; the ClientApp reads it with :func:`dpsgd_request`
    and must run DP-SGD with it (any ``nn.Module``: :class:`privkit.torch.ClientsDpSgd` or
    :func:`privkit.torch.make_private`; Poisson minibatches at rate ``min(1, b / n_i)``, each
    example's gradient clipped to C, ``N(0, (z C)^2)`` on the sum, divided by the expected
    batch) and report the steps it ran as the metric ``privkit-dpsgd-steps``, else the mod
    replaces the reply with an error and the model never leaves. The reply's metrics gain
    ``privkit-noise-multiplier``. A client with ``n_i`` records that ran ``s`` steps released
    ``DpSgdRequest.round_event(n_i, s)`` (add/remove one record); compose the rounds' events
    with :func:`privkit.epsilon`.

    The noise seed comes from the OS CSPRNG (``secrets``) and seeds the round's generator;
    ``noise_seed`` takes it from the client's ``noise/<client>`` stream of round
    ``server-round`` instead (experiments only).

    Args:
        l2_clip_norm: C, each example's gradient bound, > 0.
        noise_multiplier: z, > 0.
        batch_size: b, the expected minibatch size, >= 1.
        noise_seed: reproducible noise (experiments only).
    """

    def __init__(self, *, l2_clip_norm: float, noise_multiplier: float, batch_size: int,
                 noise_seed: int | None = None) -> None:
        self.settings = DpSgdRequest(
            l2_clip_norm=_validate.positive("l2_clip_norm", l2_clip_norm),
            noise_multiplier=_validate.positive("noise_multiplier", noise_multiplier),
            batch_size=_validate.positive_int("batch_size", batch_size))
        self.noise_seed = None if noise_seed is None else _validate.nonnegative_int(
            "noise_seed", noise_seed)

    def _seed(self, msg: Message) -> int:
        if self.noise_seed is None:
            return secrets.randbits(63)
        rng = _seeded(self.noise_seed, _train_config(msg))
        return int.from_bytes(rng.bytes(8), "little") >> 1

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg):
            return call_next(msg, context)
        name = type(self).__name__
        if keys.DPSGD in msg.content.config_records:
            return _error(msg, name, f"the train message already carries {keys.DPSGD!r}")
        try:
            seed = self._seed(msg)
        except PrivkitError as exc:
            return _error(msg, name, str(exc))
        s = self.settings
        msg.content[keys.DPSGD] = ConfigRecord({
            "l2-clip-norm": float(s.l2_clip_norm), "noise-multiplier": float(s.noise_multiplier),
            "batch-size": int(s.batch_size), "noise-seed": seed})
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        metrics = list(reply.content.metric_records.values())
        steps = metrics[0].get(keys.DPSGD_STEPS) if len(metrics) == 1 else None
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            return _error(msg, name, "the ClientApp did not confirm that it trained with "
                          f"DP-SGD (metric {keys.DPSGD_STEPS} = its local steps); its model "
                          "is not released")
        _echo(reply, keys.NOISE_MULTIPLIER, float(s.noise_multiplier))
        return reply


def dpsgd_request(msg: Message) -> DpSgdRequest | None:
    """A train message's DP-SGD request from :class:`DpSgdMod` (settings and noise seed), or
    None when the message carries none.

    Raises:
        InvalidParameterError: a malformed ``privkit-dpsgd`` record (names the entry).
    """
    if keys.DPSGD not in msg.content.config_records:
        return None
    rec = msg.content.config_records[keys.DPSGD]
    try:
        return DpSgdRequest(l2_clip_norm=_validate.positive(
                                f"{keys.DPSGD}['l2-clip-norm']", rec["l2-clip-norm"]),
                            noise_multiplier=_validate.positive(
                                f"{keys.DPSGD}['noise-multiplier']", rec["noise-multiplier"]),
                            batch_size=_validate.positive_int(
                                f"{keys.DPSGD}['batch-size']", rec["batch-size"]),
                            noise_seed=_validate.nonnegative_int(
                                f"{keys.DPSGD}['noise-seed']", rec["noise-seed"]))
    except KeyError as exc:
        raise MissingSettingError(f"{keys.DPSGD}[{exc.args[0]!r}]",
                                  "sent by DpSgdMod") from None


class ClientSideClippingMod:
    """Clip the ClientApp's update before it leaves, for
    ``ClientLevelDP(..., clipping="client")``: the reply's model ``w`` becomes
    ``w_bar + clip(w - w_bar)`` with the clip norm the server sends
    (``privkit-client-clip-norm``), or this mod's own ``l2_clip_norm`` (both given must
    agree), and the reply's metrics gain ``privkit-client-clipped`` = that norm, the
    confirmation the server requires. No noise: the server adds it to the sum.

    Args:
        l2_clip_norm: C (None: the train message's ``privkit-client-clip-norm``).
    """

    def __init__(self, l2_clip_norm: float | None = None) -> None:
        self.l2_clip_norm = None if l2_clip_norm is None else _validate.positive(
            "l2_clip_norm", l2_clip_norm)

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        from privkit.flower.central import CLIENT_CLIP_KEY, CLIENT_CLIPPED_KEY
        from privkit.mechanisms.clipping import clip_l2

        if not _is_train(msg):
            return call_next(msg, context)
        name = type(self).__name__
        try:
            sent_c = _train_config(msg).get(CLIENT_CLIP_KEY)
            clip = self.l2_clip_norm if sent_c is None else _validate.positive(
                CLIENT_CLIP_KEY, float(sent_c))
            if clip is None:
                raise MissingSettingError("l2_clip_norm", f"give the mod l2_clip_norm=... or "
                                          f"send the train config key {CLIENT_CLIP_KEY!r}")
            if self.l2_clip_norm is not None and clip != self.l2_clip_norm:
                raise PrivkitError(f"the server's clip norm {clip:g} differs from this mod's "
                                   f"{self.l2_clip_norm:g}")
            sent = _sent_arrays(msg)
        except (PrivkitError, KeyError, TypeError, ValueError) as exc:
            return _error(msg, name, str(exc))
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        try:
            rec_name, trained = _trained_like(reply, sent)
            delta = {k: trained[k].astype(np.float64) - sent[k].astype(np.float64)
                     for k in sent}
            if not all(np.isfinite(v).all() for v in delta.values()):
                delta = {k: np.zeros_like(v) for k, v in delta.items()}
            clipped = clip_l2(delta, clip) if any(v.size for v in delta.values()) else delta
        except (PrivkitError, ValueError) as exc:
            return _error(msg, name, str(exc))
        reply.content[rec_name] = keys.to_record(
            {k: (sent[k].astype(np.float64) + clipped[k]).astype(sent[k].dtype) for k in sent})
        _echo(reply, CLIENT_CLIPPED_KEY, float(clip))
        return reply


def _sent_arrays(msg: Message) -> dict[str, np.ndarray]:
    """The global model of a train message: its single ArrayRecord (any name)."""
    records = msg.content.array_records
    if len(records) != 1:
        raise PrivkitError(f"the train message must carry exactly one ArrayRecord (the model), "
                           f"it has {len(records)}")
    return keys.from_record(next(iter(records.values())))


def _trained_like(reply: Message, sent: dict[str, np.ndarray]
                  ) -> tuple[str, dict[str, np.ndarray]]:
    """The name and arrays of the reply's single ArrayRecord, refused unless there is exactly
    one and it has the global model's names and shapes."""
    records = reply.content.array_records
    if len(records) != 1:
        raise PrivkitError("the reply must carry exactly one ArrayRecord")
    name, record = next(iter(records.items()))
    trained = keys.from_record(record)
    if list(trained) != list(sent) or any(trained[k].shape != sent[k].shape for k in sent):
        raise PrivkitError("the reply's arrays differ in names or shapes from the global "
                           "model's")
    return name, trained


def _echo(reply: Message, key: str, value: float) -> None:
    """Add ``key: value`` to the reply's single MetricRecord (created if there is none)."""
    records = reply.content.metric_records
    if not records:
        reply.content[keys.METRICS] = MetricRecord({key: value})
        return
    next(iter(records.values()))[key] = value
