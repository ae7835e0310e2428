"""Client mods: privkit's output and objective perturbation around any Flower ClientApp.

Both mods act on train messages only and fail closed: a train message without the strategy's
privacy settings, or of another kind than the mod's, gets an error reply and the client's model
never leaves. The mechanism is rebuilt from the message (:func:`mechanism_from_config`), so the
client applies exactly what the server's ledger charged, and the reply echoes the mechanism's
parameter (noise multiplier, or the step epsilon) for the server to check.

Noise comes from an explicit generator, never a global one: by default privkit's
:class:`~privkit.SecureRandom` (OS entropy, nothing to seed); ``noise_seed`` gives the stream
``noise/<client>`` of round ``server-round`` in a :class:`~fl_examples.core.seeds.SeedTree` for
reproducible experiments only (whoever knows the seed can subtract the noise).

Unlike Flower's ``LocalDpMod``, clipping an unchanged model (a zero update with
``clip="update"``) is well defined: privkit's ``clip_l2`` leaves a vector inside the ball as is
and never divides by its norm.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord
from flwr.clientapp.typing import ClientAppCallable

from fl_examples.core.seeds import SeedTree
from fl_examples.flower import records as keys
from fl_examples.flower.privacy import PrivacySettings, mechanism_from_config
from privkit import _validate
from privkit._rng import SecureRandom
from privkit.errors import PrivkitError

__all__ = ["OutputPerturbationMod", "ObjectivePerturbationMod", "RecMod", "MOD_FAILED"]

#: Flower's error code for a mod whose precondition failed (``ErrorCode.MOD_FAILED_PRECONDITION``).
MOD_FAILED = 6


def _error(msg: Message, mod: str, reason: str) -> Message:
    return Message(Error(code=MOD_FAILED, reason=f"{mod}: {reason}"), reply_to=msg)


def _is_train(msg: Message) -> bool:
    return msg.metadata.message_type.split(".")[0] == "train"


class _PrivacyMod:
    """Shared plumbing: which kind, the noise generator, reading the message."""

    kind = ""

    def __init__(self, *, noise_seed: int | None = None) -> None:
        self.noise_seed = None if noise_seed is None else _validate.nonnegative_int(
            "noise_seed", noise_seed)

    @property
    def name(self) -> str:
        return type(self).__name__

    def rng(self, config: Any, context: Context) -> Any:
        """The noise generator of this client and round."""
        if self.noise_seed is None:
            return SecureRandom()
        if keys.CLIENT not in config:
            raise PrivkitError(f"noise_seed needs the client id ({keys.CLIENT}) in the config")
        client = int(config[keys.CLIENT])
        return SeedTree(self.noise_seed).numpy(int(config[keys.SERVER_ROUND]), f"noise/{client}")

    def mechanism(self, msg: Message) -> tuple[Any, Any, Any]:
        """(config, settings, mechanism) of a train message; raises PrivkitError if unusable."""
        if len(msg.content.config_records) != 1:
            raise PrivkitError("the train message must carry exactly one ConfigRecord")
        config = next(iter(msg.content.config_records.values()))
        settings, mech = mechanism_from_config(config)
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
        ``ClientApp(mods=[OutputPerturbationMod()])`` with a strategy given
        ``privacy=PrivacySettings("output", l2_clip_norm=10, stddev=0.8)``.
    """

    kind = "output"

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg):
            return call_next(msg, context)
        try:
            config, settings, mech = self.mechanism(msg)
            sent = keys.from_record(msg.content.array_records[keys.ARRAYS])
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

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(msg):
            return call_next(msg, context)
        try:
            config, _, mech = self.mechanism(msg)
            like = keys.from_record(msg.content.array_records[keys.ARRAYS])
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

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        from privkit.mechanisms.rec import encode

        if not _is_train(msg):
            return call_next(msg, context)
        try:
            if len(msg.content.config_records) != 1:
                raise PrivkitError("the train message must carry exactly one ConfigRecord")
            config = next(iter(msg.content.config_records.values()))
            settings = PrivacySettings.from_config(config)
            if settings is None or settings.kind != self.kind:
                got = "no privacy settings" if settings is None else settings.kind
                raise PrivkitError(f"the strategy sent {got}; this client sends its update only "
                                   "through DP-REC (privacy kind rec)")
            sent = keys.from_record(msg.content.array_records[keys.ARRAYS])
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
