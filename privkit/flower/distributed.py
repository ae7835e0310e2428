"""Distributed DP on Flower's SecAgg+: client-level DP without a trusted aggregator.

:class:`~privkit.flower.ClientLevelDP` trusts the server with the clipped updates. Here each
client adds its own noise share (:class:`privkit.mechanisms.DistributedSkellam`: clip, public
randomized Hadamard rotation, scaling, conditional rounding, a ``Skellam(mu)`` share, reduction
modulo ``2^bits``) and the server learns only the sum modulo ``2^bits`` through **Flower's own
SecAgg+**. Flower 1.42 offers secure aggregation only in its legacy (Driver API) stack: the
server workflow ``flwr.server.workflow.SecAggPlusWorkflow`` (run by ``DefaultWorkflow`` with a
``LegacyContext`` and a legacy ``flwr.server.strategy.Strategy``) and the client mod
``flwr.client.mod.secaggplus_mod``; the message API (``flwr.serverapp.strategy``) has no
SecAgg+ equivalent. privkit plugs into both ends of it:

- :class:`DistributedDP`: a legacy strategy wrapping another (``FedAvg``, ``FedAdam``, ...).
  Each round it samples the cohort (every connected node with probability ``client_rate``;
  ``SecureRandom``, or a seed tree), **skips** a round whose cohort is below
  ``min_survivors`` (nothing sent, nothing charged), **charges** its ledger (zero-out) before
  any message leaves, and sends the sampled nodes the mechanism's settings and the round's
  public rotation seed in the fit config. In ``aggregate_fit`` it takes the modular sum
  SecAgg+ unmasked and the survivors count SecAgg+ reports (``len(results)``: the nodes whose
  masked vectors are in the sum, those that dropped out after masking included), **refuses** a
  round below ``min_survivors`` (nothing released; the charge made before the round stays, as
  it must: the round's noise shares were drawn), decodes (centre, unscale, rotate back, divide
  by the public ``q N``) and hands the inner strategy one synthetic reply ``w + mean``.
- :class:`DistributedDpMod`: the client half. After the ClientApp trained, it encodes the
  update ``w - w_global`` with the client's own noise share (``SecureRandom``, or a seed tree
  with ``noise_seed``, experiments only) and replaces the reply's parameters with the residues
  in the form SecAgg+ carries exactly (below), its weight with 1 and its metrics with none
  (they would reach the server unmasked). It must run **inside** ``secaggplus_mod`` (Flower
  runs the first mod of the list outermost, so ``secaggplus_mod`` masks what privkit's mod
  returns): ``ClientApp(client_fn=..., mods=[secaggplus_mod, DistributedDpMod()])``. The mod
  checks the order and SecAgg+'s parameters and fails closed (it raises: the node's reply is
  an error, SecAgg+ counts it as dropped, the model never leaves).
- :func:`secaggplus_workflow`: SecAgg+ configured for privkit's integers.

**How the integers pass exactly (SecAgg+'s quantisation configured, not replaced).** SecAgg+
multiplies a client's vector by ``round(w / max_weight * T) / T`` (w its ``num_examples``),
clips it to ``[-c, c]``, maps it to ``(x + c) T / (2 c)``, rounds stochastically, masks in
``Z_M`` and, after unmasking, applies ``S -> (S - n c) T / (n T mod M)`` to the sum ``S mod
M`` of n vectors. privkit sets ``M = 2^bits``, ``T = M - 1``, ``c = T / 2``, ``max_weight = 1``
and sends weight 1 and ``x = y - c`` for the residues ``y`` in ``[0, M)``: the weight factor is
exactly 1, the quantiser is ``x + c = y`` (an integer, which stochastic rounding leaves as it
is), so SecAgg+ sums exactly privkit's residues modulo ``2^bits`` (its masks live in the same
group). On the server :func:`modular_sum_from_secaggplus` inverts the final affine map, which
is exact in float64 (``2 (S - n c)`` is an integer below ``2^53``; the result is checked to be
an integer in ``[0, M)``, else the round is refused). SecAgg+ casts to int32 and asks for a
modulus below ``2^32``: ``bits`` is at most 31. Replacing SecAgg+ by privkit's own masking
would duplicate security-critical cryptography (key agreement, Shamir shares, dropout
recovery); configuring it keeps Flower's code for that untouched.

Trust and accounting: :data:`privkit.mechanisms.DISTRIBUTED_TRUST_ASSUMPTION` (an
honest-but-curious server that runs the protocol, clients that add their shares, bounds on
dropouts and colluders), with SecAgg+ as the secure aggregation (its own threshold is the
guard against a server that lies about dropouts). A released round is charged
``SkellamDpEvent`` amplified at ``q' = P(node sampled | cohort >= min_survivors)`` by joint
convexity (against outsiders only; every node in every round: no amplification); against the
server, which picks the cohort, :meth:`DistributedDP.report` gives the unamplified epsilon.
Relation: zero-out (a node's update replaced by zero, its noise share kept).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from logging import DEBUG, ERROR, INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from flwr.supercore import log

import privkit
from privkit import _validate
from privkit._rng import SecureRandom
from privkit.accountants.distributed import released_rate
from privkit.accountants.rules import NeighboringRelation
from privkit.errors import BudgetExceededError, InvalidParameterError, PrivkitError
from privkit.events.distributed import DISTRIBUTED_TRUST_ASSUMPTION
from privkit.ledger import Ledger
from privkit.mechanisms.distributed import DistributedSkellam
from privkit.seeds import SeedTree

__all__ = ["DistributedDP", "DistributedDpMod", "secaggplus_workflow",
           "secaggplus_parameters", "modular_sum_from_secaggplus", "released_rate",
           "client_noise_stream", "MAX_SECAGG_BITS", "POPULATION", "CONFIG_PREFIX",
           "ROTATION_SEED", "SERVER_ROUND", "SECAGG_NOTE"]

#: SecAgg+ quantises to int32 and wants a modulus below 2^32.
MAX_SECAGG_BITS = 31
#: The ledger id charged each released round (every node's guarantee is the population's).
POPULATION = "population"
#: Fit-config keys: the mechanism's fields (``privkit-distributed-<field>``), the round's public
#: rotation seed, and the server round (the seeded noise stream's round).
CONFIG_PREFIX = "privkit-distributed-"
ROTATION_SEED = "privkit-rotation-seed"
SERVER_ROUND = "privkit-server-round"
#: The mechanism's fields a fit config carries.
_FIELDS = ("l2_clip_norm", "granularity", "noise_per_client", "bits", "dim", "min_survivors",
           "colluders", "beta", "sampling_probability")
#: What the Flower variant adds to the trust assumption.
SECAGG_NOTE = ("secure aggregation is Flower's SecAgg+ (flwr.server.workflow.SecAggPlusWorkflow "
               "with flwr.client.mod.secaggplus_mod), configured to carry privkit's residues "
               "exactly; its reconstruction threshold is its own guard against a server that "
               "claims dropouts that did not happen")


# ---------------------------------------------------------------------------- SecAgg+ setup
def secaggplus_parameters(bits: int) -> dict[str, Any]:
    """SecAgg+'s quantisation settings under which it carries residues modulo ``2^bits``
    exactly (module docstring): ``max_weight`` 1, ``clipping_range`` (2^bits - 1) / 2,
    ``quantization_range`` 2^bits - 1, ``modulus_range`` 2^bits.

    Example:
        >>> p = secaggplus_parameters(16)
        >>> p["max_weight"], p["clipping_range"], p["quantization_range"], p["modulus_range"]
        (1.0, 32767.5, 65535, 65536)
    """
    b = _validate.positive_int("bits", bits)
    if not 2 <= b <= MAX_SECAGG_BITS:
        raise InvalidParameterError("bits", bits, f"an integer in [2, {MAX_SECAGG_BITS}] "
                                    "(SecAgg+ quantises to int32, modulus below 2^32)")
    m = 1 << b
    return {"max_weight": 1.0, "clipping_range": (m - 1) / 2.0, "quantization_range": m - 1,
            "modulus_range": m}


def secaggplus_workflow(bits: int, *, num_shares: int | float = 1.0,
                        reconstruction_threshold: int | float = 0.5,
                        timeout: float | None = None) -> Any:
    """Flower's ``SecAggPlusWorkflow`` with :func:`secaggplus_parameters` (the mechanism's
    ``bits``); ``num_shares`` and ``reconstruction_threshold`` are SecAgg+'s own (here: every
    sampled node holds a share of every other's keys, and half of them recover a dropped
    node's masks). Run it as ``DefaultWorkflow(fit_workflow=secaggplus_workflow(bits))``."""
    from flwr.server.workflow import SecAggPlusWorkflow

    return SecAggPlusWorkflow(num_shares, reconstruction_threshold, timeout=timeout,
                              **secaggplus_parameters(bits))


def modular_sum_from_secaggplus(aggregated: Any, survivors: int, bits: int) -> np.ndarray:
    """The sum modulo ``2^bits`` of the residues of ``survivors`` clients, from the vector
    ``SecAggPlusWorkflow`` hands the strategy (its dequantised, reweighted sum under
    :func:`secaggplus_parameters`): ``S = v (M - n) / T + n c`` (module docstring).

    Raises:
        PrivkitError: the vector is not the image of an integer sum in ``[0, 2^bits)`` (a
            workflow or clients configured otherwise): the round must not be released.

    Example:
        >>> m, t = 1 << 8, 255
        >>> s = np.array([0, 17, 255])            # the residues' sum modulo 2^8, n = 3
        >>> v = (s - 3 * t / 2) * (t / ((3 * t) % m))  # what SecAgg+ hands the strategy
        >>> modular_sum_from_secaggplus(v, 3, 8)
        array([  0,  17, 255], dtype=uint64)
    """
    b = _validate.positive_int("bits", bits)
    n = _validate.positive_int("survivors", survivors)
    m = 1 << b
    t = m - 1
    qt = (n * t) % m
    if n >= m:  # SecAgg+'s weight total n T mod 2^bits would vanish (n = 2^bits)
        raise PrivkitError(f"{n} survivors: SecAgg+ carries the weights of fewer than "
                           f"2^bits = {m} clients")
    v = np.asarray(aggregated, dtype=np.float64).reshape(-1)
    if not np.isfinite(v).all() or qt == 0:
        raise PrivkitError("the secure sum is not finite: not SecAgg+'s output under "
                           "secaggplus_parameters")
    twice = v * (2.0 * qt / t)  # 2 (S - n c), an integer up to the workflow's rounding
    k = np.rint(twice)
    slack = 1e-9 + 16 * 2.0**-53 * np.abs(twice)  # a few ulps of two multiplications
    if (np.abs(twice - k) > slack).any():
        raise PrivkitError("the secure sum is not an integer sum: SecAgg+ was not configured "
                           "with secaggplus_parameters, or a client sent other values")
    s = (k + n * t) / 2.0  # exact: integers below 2^53
    if not ((s == np.floor(s)) & (s >= 0) & (s < m)).all():
        raise PrivkitError("the secure sum is not a residue modulo 2^bits: SecAgg+ was not "
                           "configured with secaggplus_parameters")
    return s.astype(np.uint64)


def client_noise_stream(noise_seed: int, server_round: int, node_id: int) -> Any:
    """The seeded stream of a node's rounding coins and noise share (``noise_seed``: for
    reproducible experiments only): ``distributed-noise/<node>`` of the server round."""
    return SeedTree(noise_seed).numpy(int(server_round), f"distributed-noise/{int(node_id)}")


def _to_config(mech: DistributedSkellam) -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    for name in _FIELDS:
        value = getattr(mech, name)
        out[CONFIG_PREFIX + name.replace("_", "-")] = int(value) if isinstance(value, int) \
            else float(value)
    return out


def _from_config(config: Any) -> DistributedSkellam:
    kw = {}
    for name in _FIELDS:
        key = CONFIG_PREFIX + name.replace("_", "-")
        if key not in config:
            raise PrivkitError(f"the fit config lacks {key!r} (sent by privkit's DistributedDP)")
        kw[name] = config[key]
    return DistributedSkellam(**kw)


# ---------------------------------------------------------------------------- the client
def _refuse(reason: str) -> PrivkitError:
    """The mod's refusal: an exception, not an error reply (``secaggplus_mod`` reads its inner
    reply's content unchecked; Flower's runtime turns the exception into the node's error
    reply, so SecAgg+ counts the node as dropped and nothing of it is summed)."""
    return PrivkitError(f"DistributedDpMod: {reason}")


class DistributedDpMod:
    """The client half of :class:`DistributedDP` (module docstring): encode the update with
    this client's own noise share, inside ``secaggplus_mod``.

    Args:
        mechanism: this client's own settings (a :class:`DistributedSkellam`); the server's
            must then match them in every field (else an error reply). None: use the
            server's (sent in the fit config).
        noise_seed: draw the rounding coins and the noise share from
            :func:`client_noise_stream` (reproducible experiments only: whoever knows the seed
            can subtract the noise). None (default): :class:`privkit.SecureRandom`.
    """

    def __init__(self, mechanism: DistributedSkellam | None = None, *,
                 noise_seed: int | None = None) -> None:
        if mechanism is not None and not isinstance(mechanism, DistributedSkellam):
            raise InvalidParameterError("mechanism", mechanism, "a DistributedSkellam or None")
        if mechanism is not None and mechanism.bits > MAX_SECAGG_BITS:
            raise InvalidParameterError("mechanism", f"bits={mechanism.bits}",
                                        f"bits <= {MAX_SECAGG_BITS} (SecAgg+)")
        self.mechanism = mechanism
        self.noise_seed = None if noise_seed is None else _validate.nonnegative_int(
            "noise_seed", noise_seed)

    @staticmethod
    def _check_inside(msg: Message, context: Context) -> None:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        state = context.state.config_records.get(RECORD_KEY_STATE)
        # inside secaggplus_mod, in its collect stage: it popped the stage from the message's
        # configs (the keys forwarded with the model remain) and saved its setup in the state
        inside = configs is not None and Key.STAGE not in configs \
            and Key.CIPHERTEXT_LIST in configs and state is not None \
            and state.get("current_stage") == Stage.SHARE_KEYS
        if not inside:
            raise PrivkitError("it must run inside Flower's secaggplus_mod, on the train "
                               "message that carries the model: ClientApp(client_fn=..., "
                               "mods=[secaggplus_mod, DistributedDpMod()]) (the first mod is "
                               "the outermost); nothing is sent without secure aggregation")

    @staticmethod
    def _check_secaggplus(context: Context, bits: int) -> None:
        state = context.state.config_records[RECORD_KEY_STATE]
        want = secaggplus_parameters(bits)
        got = {"max_weight": state.get("max_weight"),
               "clipping_range": state.get("clipping_range"),
               "quantization_range": state.get("target_range"),
               "modulus_range": state.get("mod_range")}
        if got != want:
            diff = next(k for k in want if got[k] != want[k])
            raise PrivkitError(f"SecAgg+'s {diff} is {got[diff]!r}, not {want[diff]!r}: it would "
                               "not carry the residues exactly (build the workflow with "
                               "privkit.flower.secaggplus_workflow(bits))")

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        try:
            self._check_inside(msg, context)
            fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
            sent = _settings(fitins.config)
            if self.mechanism is not None:
                own = dataclasses.replace(self.mechanism, sampling_probability=float(
                    sent.sampling_probability))
                diff = next((f for f in _FIELDS if getattr(own, f) != getattr(sent, f)), None)
                if diff is not None:
                    raise PrivkitError(f"the server's {diff}={getattr(sent, diff)!r} differs "
                                       f"from this client's {getattr(own, diff)!r}")
                sent = own
            mech = sent
            self._check_secaggplus(context, int(mech.bits))
            seed = _validate.nonnegative_int(ROTATION_SEED, fitins.config[ROTATION_SEED])
            server_round = _validate.positive_int(SERVER_ROUND, fitins.config[SERVER_ROUND])
            glob = parameters_to_ndarrays(fitins.parameters)
        except (PrivkitError, KeyError, TypeError, ValueError) as exc:
            raise _refuse(str(exc)) from None
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        try:
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
            trained = parameters_to_ndarrays(fitres.parameters)
            if len(trained) != len(glob) or any(a.shape != b.shape
                                                for a, b in zip(trained, glob)):
                raise PrivkitError("the ClientApp's parameters differ in number or shapes "
                                   "from the global model's")
            update = np.concatenate([(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                                     .reshape(-1) for a, b in zip(trained, glob)])
            rng = SecureRandom() if self.noise_seed is None else client_noise_stream(
                self.noise_seed, server_round, context.node_id)
            residues = mech.encode(update, rng=rng, rotation_seed=seed)
        except (PrivkitError, ValueError) as exc:
            raise _refuse(str(exc)) from None
        c = secaggplus_parameters(int(mech.bits))["clipping_range"]
        out = ndarrays_to_parameters([residues.astype(np.float64) - c])
        reply.content["fitres.parameters"] = compat.parameters_to_arrayrecord(out,
                                                                            keep_input=True)
        reply.content["fitres.num_examples"] = MetricRecord({"num_examples": 1})
        reply.content["fitres.metrics"] = ConfigRecord({})  # raw client data: not sent
        return reply


def _settings(config: Any) -> DistributedSkellam:
    try:
        mech = _from_config(config)
    except InvalidParameterError as exc:
        raise PrivkitError(f"the server's mechanism settings are invalid: {exc}") from None
    if mech.bits > MAX_SECAGG_BITS:
        raise PrivkitError(f"bits={mech.bits}: SecAgg+ carries at most {MAX_SECAGG_BITS} bits")
    return mech


# ---------------------------------------------------------------------------- the server
@dataclasses.dataclass(frozen=True)
class _Round:
    server_round: int
    parameters: Parameters
    sampled: frozenset[int]
    rotation_seed: int


class DistributedDP(Strategy):
    """Client-level DP with secure aggregation around a legacy Flower strategy (module
    docstring). Run it in ``DefaultWorkflow(fit_workflow=secaggplus_workflow(bits))`` with a
    ``LegacyContext``; the ClientApp runs ``[secaggplus_mod, DistributedDpMod()]``.

    Args:
        strategy: the inner legacy strategy (``flwr.server.strategy.FedAvg``, ``FedAdam``,
            ...); its ``configure_fit`` supplies the fit config (e.g. FedProx's
            ``proximal_mu``) and its ``aggregate_fit`` gets one synthetic reply, the model
            ``w + mean`` with weight 1; evaluation passes through (not private).
        num_clients: N, the nodes sampled from (waits up to ``node_timeout`` for them).
        client_rate: q in (0, 1], each node's probability of joining a round; the decoded sum
            is divided by ``q N``.
        mechanism: the clients' :class:`DistributedSkellam` (e.g.
            ``DistributedSkellam(**calibrate_distributed(...).mechanism_kwargs())``), bits at
            most 31 and ``min_survivors`` at least 2 (SecAgg+ needs two nodes); its
            ``sampling_probability`` is replaced by :func:`released_rate` (1 at q = 1).
        ledger: a privkit ledger under zero-out (``neighboring_relation="zero-out"``); None: a
            new in-memory one at ``delta`` (default 1e-5).
        max_epsilon: stop before a round that would take the population above it.
        seed: draw the sampling and the rotation seeds from this seed tree (experiments);
            None: privkit's SecureRandom (the rotation seed is public either way).
        run_id: recorded with every charge.
        node_timeout: seconds to wait for ``num_clients`` nodes.

    Raises:
        InvalidParameterError: a bad argument (named).
    """

    def __init__(self, strategy: Strategy, *, num_clients: int, client_rate: float,
                 mechanism: DistributedSkellam, ledger: Ledger | None = None,
                 delta: float | None = None, max_epsilon: float | None = None,
                 seed: int | None = None, run_id: str = "flower",
                 node_timeout: float = 30.0) -> None:
        if not isinstance(strategy, Strategy) or isinstance(strategy, DistributedDP):
            raise InvalidParameterError("strategy", strategy, "a legacy Flower strategy "
                                        "(flwr.server.strategy.Strategy), not already wrapped")
        self.strategy = strategy
        self.num_clients = _validate.positive_int("num_clients", num_clients)
        self.client_rate = _validate.probability("client_rate", client_rate)
        if not isinstance(mechanism, DistributedSkellam):
            raise InvalidParameterError("mechanism", mechanism, "a DistributedSkellam")
        if mechanism.bits > MAX_SECAGG_BITS:
            raise InvalidParameterError("mechanism", f"bits={mechanism.bits}",
                                        f"bits <= {MAX_SECAGG_BITS} (SecAgg+ quantises to "
                                        "int32)")
        if mechanism.min_survivors < 2:
            raise InvalidParameterError("mechanism", f"min_survivors={mechanism.min_survivors}",
                                        "min_survivors >= 2 (SecAgg+ needs two nodes)")
        if mechanism.min_survivors > self.num_clients:
            raise InvalidParameterError("mechanism", f"min_survivors={mechanism.min_survivors}",
                                        f"min_survivors <= num_clients {self.num_clients}")
        q_rel = released_rate(self.num_clients, self.client_rate, mechanism.min_survivors)
        self.mechanism = dataclasses.replace(mechanism, sampling_probability=q_rel)
        self.max_epsilon = None if max_epsilon is None else _validate.positive(
            "max_epsilon", max_epsilon)
        self.seed = None if seed is None else _validate.nonnegative_int("seed", seed)
        if not (isinstance(run_id, str) and run_id):
            raise InvalidParameterError("run_id", run_id, "a non-empty string")
        self.run_id = run_id
        self.node_timeout = _validate.positive("node_timeout", node_timeout)
        rel = NeighboringRelation.REPLACE_SPECIAL
        if ledger is None:
            d = 1e-5 if delta is None else _validate.delta("delta", delta)
            ledger = Ledger.create(None, population_id=f"flower-distributed|{run_id}", delta=d,
                                   neighboring_relation=rel)
        elif not isinstance(ledger, Ledger):
            raise InvalidParameterError("ledger", ledger, "a privkit Ledger")
        elif delta is not None and _validate.delta("delta", delta) != ledger.delta:
            raise InvalidParameterError("delta", delta, f"the ledger's delta {ledger.delta:g}")
        if ledger.neighboring_relation != rel:
            raise InvalidParameterError("ledger", ledger.neighboring_relation.name,
                                        "a ledger for REPLACE_SPECIAL (zero-out: a client's "
                                        "noise share stays when its update is zeroed)")
        self.ledger = ledger
        self.stopped: str | None = None
        self._round: _Round | None = None
        #: The server's own record of each round (never in the round metrics): ``status``
        #: (``released``; ``skipped``: cohort below min_survivors, nothing sent or charged;
        #: ``refused``: fewer survivors, charged, nothing released; ``sent``: charged and sent,
        #: but SecAgg+ halted before the sum (too few nodes for its threshold), nothing
        #: released; ``stopped``), and for a released round the survivors' count and node
        #: ids and the rotation seed.
        self.rounds: dict[int, dict[str, Any]] = {}
        #: The last released modular sum (what SecAgg+ revealed), for inspection.
        self.last_modular_sum: np.ndarray | None = None

    # -- numbers -----------------------------------------------------------------------------
    @property
    def expected_clients(self) -> float:
        """q N, the public divisor."""
        return self.client_rate * self.num_clients

    @property
    def event(self) -> Any:
        """A released round's event (charged before the round's messages leave)."""
        return self.mechanism.event()

    def epsilon(self) -> float:
        return float(self.ledger.epsilons([POPULATION])[POPULATION])

    def charged_rounds(self) -> int:
        return int(sum(n for _, n in self.ledger.composition(POPULATION).atoms))

    def _price(self, extra: list[Any], relation: Any) -> float:
        atoms = [privkit.SelfComposedDpEvent(a, n)
                 for a, n in self.ledger.composition(POPULATION).atoms] + extra
        if not atoms:
            return 0.0
        return float(privkit.epsilon(privkit.ComposedDpEvent(atoms), self.ledger.delta,
                                     neighboring_relation=relation))

    def _stop(self, server_round: int, why: str) -> None:
        self.stopped = f"stopped before server round {server_round}: {why}"
        self.rounds[server_round] = {"status": "stopped"}
        log(WARNING, "DistributedDP: %s", self.stopped)

    # -- legacy strategy ---------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.strategy.initialize_parameters(client_manager)

    def _nodes(self, client_manager: ClientManager) -> dict[int, ClientProxy]:
        n = self.num_clients
        if client_manager.num_available() < n:
            log(INFO, "DistributedDP: waiting up to %g s for num_clients=%d nodes",
                self.node_timeout, n)
            client_manager.wait_for(n, timeout=int(math.ceil(self.node_timeout)))
        proxies = {int(p.node_id): p for p in client_manager.all().values()}
        if len(proxies) != n:
            raise RuntimeError(f"DistributedDP: {len(proxies)} nodes connected but "
                               f"num_clients={n}: the sample and the divisor q N must cover "
                               "the same population (nothing was charged)")
        return proxies

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        """Sample, skip a cohort below min_survivors, charge, send settings and the rotation
        seed (module docstring)."""
        self._round = None
        if self.stopped is not None:
            return []
        event = self.event
        over = bool(self.ledger.would_exceed([POPULATION], event)[0])
        if over or (self.max_epsilon is not None and self._price(
                [event], NeighboringRelation.REPLACE_SPECIAL) > self.max_epsilon):
            limit = "the ledger's epsilon_budget" if over else f"max_epsilon={self.max_epsilon:g}"
            self._stop(server_round, f"one more round would exceed {limit} at delta "
                       f"{self.ledger.delta:g} (epsilon now {self.epsilon():.6g})")
            return []
        proxies = self._nodes(client_manager)
        ids = sorted(proxies)
        if self.seed is None:
            u = np.asarray(SecureRandom().uniform(len(ids)), dtype=np.float64)
            rotation = secrets.randbits(62)
        else:
            tree = SeedTree(self.seed)
            u = tree.uniforms(server_round, "poisson-clients", ids)[:, 0]
            rotation = int(tree.sequence(server_round, "distributed-rotation")
                           .generate_state(1, np.uint64)[0] >> np.uint64(2))
        sampled = [nid for nid, x in zip(ids, u) if x < self.client_rate]
        if len(sampled) < self.mechanism.min_survivors:  # nothing sent, nothing charged
            self.rounds[server_round] = {"status": "skipped"}
            log(INFO, "DistributedDP: round %d skipped (the cohort is below min_survivors=%d; "
                "nothing sent or charged)", server_round, self.mechanism.min_survivors)
            return []
        inner = self.strategy.configure_fit(server_round, parameters, client_manager)
        config: dict[str, Scalar] = dict(inner[0][1].config) if inner else {}
        try:  # write-ahead: the ledger knows before any node does
            self.ledger.spend([POPULATION], event, label="distributed DP secure sum",
                              round=int(server_round), run_id=self.run_id)
        except BudgetExceededError as exc:
            self._stop(server_round, str(exc))
            return []
        config |= _to_config(self.mechanism) | {ROTATION_SEED: int(rotation),
                                                SERVER_ROUND: int(server_round)}
        self._round = _Round(server_round, parameters, frozenset(sampled), int(rotation))
        self.rounds[server_round] = {"status": "sent"}  # until SecAgg+ hands back a sum
        log(INFO, "DistributedDP: round %d charged, epsilon %.4g at delta %g", server_round,
            self.epsilon(), self.ledger.delta)
        log(DEBUG, "DistributedDP: round %d sampled nodes %s", server_round, sorted(sampled))
        return [(proxies[nid], FitIns(parameters, dict(config))) for nid in sampled]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Decode SecAgg+'s modular sum over its survivors, or refuse the round (module
        docstring); the inner strategy aggregates ``w + mean``."""
        sent = self._round if self._round is not None and \
            self._round.server_round == server_round else None
        if sent is None:
            return None, self._metrics()
        survivors = len(results)
        mech = self.mechanism
        if survivors < mech.min_survivors or any(int(p.node_id) not in sent.sampled
                                                 for p, _ in results):
            self.rounds[server_round] = {"status": "refused", "survivors": survivors}
            log(WARNING, "DistributedDP: round %d refused: %d survivor(s) in the secure sum, "
                "fewer than min_survivors=%d (or a node that was not sampled); nothing "
                "released, the round stays charged", server_round, survivors,
                mech.min_survivors)
            return None, self._metrics()
        try:
            arrays = parameters_to_ndarrays(results[0][1].parameters)
            if len(arrays) != 1 or arrays[0].shape != (mech.padded_dim,):
                raise PrivkitError(f"the secure sum has shapes {[a.shape for a in arrays]}, "
                                   f"not [({mech.padded_dim},)]")
            total = modular_sum_from_secaggplus(arrays[0], survivors, int(mech.bits))
            flat = mech.decode(total, survivors=survivors, divisor=self.expected_clients,
                               rotation_seed=sent.rotation_seed)
            glob = parameters_to_ndarrays(sent.parameters)
            if sum(a.size for a in glob) != mech.dim:
                raise PrivkitError(f"the global model has {sum(a.size for a in glob)} "
                                   f"coordinates, the mechanism {mech.dim}")
        except (PrivkitError, InvalidParameterError) as exc:
            self.rounds[server_round] = {"status": "refused", "survivors": survivors}
            log(ERROR, "DistributedDP: round %d refused: %s", server_round, exc)
            return None, self._metrics()
        new, start = [], 0
        for a in glob:
            part = flat[start:start + a.size].reshape(a.shape)
            new.append((a.astype(np.float64) + part).astype(a.dtype))
            start += a.size
        self.last_modular_sum = total
        self.rounds[server_round] = {"status": "released", "survivors": survivors,
                                     "nodes": sorted(int(p.node_id) for p, _ in results),
                                     "rotation_seed": sent.rotation_seed}
        synthetic = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new), 1, {})
        params, inner = self.strategy.aggregate_fit(server_round, [(results[0][0], synthetic)],
                                                    [])
        log(INFO, "DistributedDP: round %d released the decoded sum over q N = %.4g",
            server_round, self.expected_clients)
        return params, dict(inner or {}) | self._metrics()

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> Any:
        return self.strategy.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> Any:
        return self.strategy.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> Any:
        return self.strategy.evaluate(server_round, parameters)

    def _metrics(self) -> dict[str, Scalar]:
        out: dict[str, Scalar] = {"privkit-epsilon": self.epsilon(),
                                  "privkit-delta": float(self.ledger.delta),
                                  "privkit-bits": int(self.mechanism.bits)}
        if self.stopped is not None:
            out["privkit-budget-stopped"] = 1
        return out

    # -- the privacy section -----------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The run's privacy section: the population's epsilon (zero-out), replace-one beside
        it, the unamplified epsilon against the server, the mechanism and what it assumes."""
        from privkit.accountants.distributed import wraparound_probability

        m = self.mechanism
        rounds = self.charged_rounds()
        delta = float(self.ledger.delta)
        status = [r["status"] for r in self.rounds.values()]

        def unamplified(k: int) -> float:
            return 0.0 if not k else float(privkit.epsilon(
                m.unamplified_event(k), delta,
                neighboring_relation=NeighboringRelation.REPLACE_SPECIAL).epsilon)

        k = max(1, math.ceil(self.client_rate * rounds)) if rounds else 0
        l2, l1 = m.sensitivities
        return {
            "mechanism": "distributed Skellam over Flower's SecAgg+ "
                         "(privkit.flower.DistributedDP)",
            "privacy_unit": "client", "epsilon": self.epsilon(), "delta": delta,
            "neighboring_relation": "zero-out client (replace_special)",
            "epsilon_replace_one": self._price([], NeighboringRelation.REPLACE_ONE),
            "epsilon_unamplified": {"expected_participations": k,
                                    "epsilon_at_expected": unamplified(k),
                                    "every_round": rounds,
                                    "epsilon_every_round": unamplified(rounds),
                                    "note": "against the server, which picks the cohort"},
            "charged_rounds": rounds, "released_rounds": status.count("released"),
            "refused_rounds": status.count("refused"),
            "halted_rounds": status.count("sent"),
            "skipped_rounds": status.count("skipped"),
            "bits": int(m.bits), "granularity": float(m.granularity),
            "noise_per_client": float(m.noise_per_client),
            "min_survivors": int(m.min_survivors), "colluders": int(m.colluders),
            "rounded_norm_bound_sq": m.norm_bound_sq, "l2_sensitivity": l2,
            "l1_sensitivity": l1,
            "wrap_bound_per_round": wraparound_probability(
                clients=self.num_clients, noise_per_client=float(m.noise_per_client),
                scaled_clip=m.scaled_clip, padded_dim=m.padded_dim, bits=int(m.bits)),
            "client_rate": self.client_rate, "released_rate": float(m.sampling_probability),
            "num_clients": self.num_clients, "expected_clients": self.expected_clients,
            "trust": DISTRIBUTED_TRUST_ASSUMPTION,
            "assumptions": [DISTRIBUTED_TRUST_ASSUMPTION, SECAGG_NOTE],
            "randomness": {"clients": "each DistributedDpMod's own (SecureRandom unless "
                                      "noise_seed)",
                           "server": "sampling and rotation seeds from SecureRandom" if
                           self.seed is None else "seeded: a simulation"},
            "public": [f"N = {self.num_clients}", f"q = {self.client_rate:g} and the divisor "
                       f"q N = {self.expected_clients:g}", "the mechanism's settings and "
                       "every round's rotation seed", "the number of rounds"]}

    def __repr__(self) -> str:
        m = self.mechanism
        return (f"DistributedDP({type(self.strategy).__name__}, num_clients={self.num_clients},"
                f" client_rate={self.client_rate:g}, bits={m.bits}, "
                f"min_survivors={m.min_survivors})")
