"""Client side: privkit's local solver behind Flower messages, and a ready ClientApp.

:func:`local_update` runs one client's FedProx / Upcycled-FL odd-step solve with the batched
solver of :mod:`fl_examples.core.local` (K = 1), seeded from the train message. With the
``joint`` batch order (default) it redraws the batch orders of every client selected in the
round from the round's ``batches`` stream, exactly as privkit's batched simulator draws them in
one call, and keeps its own: the client then visits the same minibatches as in the simulator.
That needs the selected clients' sizes and epochs, which the server sends. With ``per-client``
each client draws from its own stream ``batches/<client>`` and learns nothing about the others.

:func:`make_client_app` builds a ClientApp (train, evaluate, and the roster query the strategy
sends once) over a :class:`~fl_examples.core.data.FederatedDataset`; a node is the client whose
index is its ``partition-id`` node config (Flower's simulation sets it; give it to
``flower-supernode --node-config``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from fl_examples.core.data import FederatedDataset, Split, parse_dataset_spec
from fl_examples.core.dpsgd import DpSgdSettings, local_dpsgd, steps_per_client
from fl_examples.core.local import BatchOrder, ClientData, batch_orders, local_sgd
from fl_examples.core.models import MLP, MultinomialLogReg
from fl_examples.core.rounds import broadcast, evaluate, to_client_data
from fl_examples.core.seeds import SeedTree
from privkit.errors import InvalidParameterError
from privkit.flower import records as keys
from privkit.flower.mods import DpSgdRequest, dpsgd_request
from privkit.torch import ClientStreams

__all__ = ["local_update", "roster_reply", "make_client_app", "load_federated", "make_model",
           "partition_id", "BATCH_ORDERS"]

#: How a client draws its minibatch order (see the module docstring).
BATCH_ORDERS = ("joint", "per-client")


def load_federated(spec: str, seed: int, num_clients: int | None = None) -> FederatedDataset:
    """``parse_dataset_spec(spec, seed=seed)``, restricted to its first ``num_clients`` clients."""
    ds = _load(spec, int(seed))
    if num_clients is None or int(num_clients) == ds.num_clients:
        return ds
    k = int(num_clients)
    if not 1 <= k <= ds.num_clients:
        raise InvalidParameterError("num_clients", num_clients,
                                    f"in [1, {ds.num_clients}] for {spec!r}")
    # the held-out set stays (no client of the smaller population holds it either)
    return FederatedDataset(ds.client_ids[:k], ds.x_train[:k], ds.y_train[:k], ds.x_test[:k],
                            ds.y_test[:k], ds.num_features, ds.num_classes,
                            ds.description | {"first_clients": k}, ds.x_heldout, ds.y_heldout)


@functools.lru_cache(maxsize=4)
def _load(spec: str, seed: int) -> FederatedDataset:
    return parse_dataset_spec(spec, seed=seed)


def make_model(name: str, ds: FederatedDataset) -> Any:
    """``logreg`` (multinomial logistic regression) or ``mlp`` (hidden 196) for ``ds``."""
    if name == "logreg":
        return MultinomialLogReg(ds.num_features, ds.num_classes)
    if name == "mlp":
        return MLP(ds.num_features, 196, ds.num_classes)
    raise InvalidParameterError("model", name, "logreg or mlp")


def partition_id(context: Context) -> int:
    """The client index of this node (its ``partition-id`` node config)."""
    pid = context.node_config.get(keys.PARTITION_ID)
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
        raise InvalidParameterError(
            "node_config['partition-id']", pid,
            "an integer >= 0 (flower-supernode --node-config \"partition-id=0\")")
    return pid


def _own_order(config: Mapping[str, Any], client: int, size: int, epochs: int,
               device: torch.device) -> BatchOrder:
    """This client's batch order for the round (see the module docstring)."""
    tree = SeedTree(int(config[keys.SEED]))
    r = int(config[keys.DATA_ROUND])
    mode = config.get(keys.BATCH_ORDER, "joint")
    if mode == "per-client":
        return batch_orders(torch.tensor([size], device=device),
                            torch.tensor([epochs], device=device),
                            generator=tree.torch(r, f"batches/{client}", device))
    if mode != "joint":
        raise InvalidParameterError("config['privkit-batch-order']", mode, "joint or per-client")
    selected = [int(c) for c in config[keys.SELECTED]]
    sizes = [int(n) for n in config[keys.SELECTED_SIZES]]
    all_epochs = [int(e) for e in config[keys.SELECTED_EPOCHS]]
    if client not in selected or not len(selected) == len(sizes) == len(all_epochs):
        raise InvalidParameterError("config['privkit-selected']", selected,
                                    f"a list holding client {client}, aligned with sizes/epochs")
    j = selected.index(client)
    if sizes[j] != size or all_epochs[j] != epochs:
        raise InvalidParameterError("config['privkit-selected-sizes']", sizes[j],
                                    f"this client's size {size} and epochs {epochs}")
    joint = batch_orders(torch.tensor(sizes, device=device), torch.tensor(all_epochs,
                                                                          device=device),
                         generator=tree.torch(r, "batches", device))
    start = int(joint.offsets[j])
    own = joint.order[start:start + size * epochs].clone()
    return BatchOrder(own, torch.zeros(1, dtype=torch.long, device=device))


def local_update(model: Any, global_params: Mapping[str, torch.Tensor], data: ClientData,
                 config: Mapping[str, Any], *, client: int,
                 linear_term: Mapping[str, torch.Tensor] | None = None,
                 dpsgd: DpSgdRequest | None = None) -> dict[str, torch.Tensor]:
    """One client's local solve from the global model, as the train message configures it.

    Args:
        model: a :class:`~fl_examples.core.models.BatchedModel`.
        global_params: w_bar, ``{name: tensor}`` without a client axis.
        data: this client's training data, one client (``K = 1``).
        config: the train message's config (``lr``, ``batch-size``, ``momentum``,
            ``proximal-mu``, ``privkit-seed``, ``privkit-data-round``, ``privkit-local-epochs``
            and the batch-order entries).
        client: this client's index.
        linear_term: objective perturbation's n (``{name: tensor}``), added to every gradient.
        dpsgd: the request of :class:`privkit.flower.DpSgdMod`: train
            with record-level DP-SGD instead (privkit's engine through
            :func:`fl_examples.core.dpsgd.local_dpsgd`, the client's own stream,
            ``epochs * ceil(n / b)`` steps on Poisson minibatches; ``batch-size`` and the
            batch order of the config are not used then).

    Returns:
        The trained parameters, ``{name: tensor}`` without a client axis.
    """
    if data.x.shape[0] != 1:
        raise InvalidParameterError("data", tuple(data.x.shape), "one client's data (K = 1)")
    size = int(data.sizes[0])
    epochs = int(config[keys.LOCAL_EPOCHS])
    expected = config.get(keys.CLIENT_SIZE)
    if expected is not None and int(expected) != size:
        raise InvalidParameterError("config['privkit-client-size']", expected,
                                    f"this client's training size {size}")
    dev = data.x.device
    common = dict(lr=float(config[keys.LR]), momentum=float(config[keys.MOMENTUM]),
                  proximal_mu=float(config.get(keys.PROXIMAL_MU, 0.0)))
    if dpsgd is not None:
        if linear_term is not None:
            raise InvalidParameterError("dpsgd", "with linear_term", "one mechanism at a time")
        settings = DpSgdSettings(dpsgd.l2_clip_norm, dpsgd.noise_multiplier, dpsgd.batch_size)
        out = local_dpsgd(model, broadcast(dict(global_params), 1), dict(global_params), data,
                          epochs=torch.tensor([epochs], device=dev), settings=settings,
                          clients=[client], rng=ClientStreams(seed=int(dpsgd.noise_seed)),
                          **common)
        return {k: v[0] for k, v in out.items()}
    order = _own_order(config, client, size, epochs, dev)
    lin = None if linear_term is None else {k: v.unsqueeze(0) for k, v in linear_term.items()}
    out = local_sgd(model, broadcast(dict(global_params), 1), dict(global_params), data,
                    epochs=torch.tensor([epochs], device=dev),
                    batch_size=int(config[keys.BATCH_SIZE]), order=order, linear_term=lin,
                    **common)
    return {k: v[0] for k, v in out.items()}


def roster_reply(msg: Message, *, client: int, num_examples: int) -> Message:
    """The reply to the strategy's roster query: this node's client index and |D_i|."""
    return Message(RecordDict({keys.METRICS: MetricRecord({
        keys.PARTITION_ID: int(client), keys.NUM_EXAMPLES: int(num_examples)})}), reply_to=msg)


def make_client_app(*, dataset: str | None = None, seed: int | None = None,
                    num_clients: int | None = None, model: str | None = None,
                    mods: Sequence[Mod] = (),
                    train_actions: Mapping[str, Sequence[Mod]] | None = None,
                    torch_threads: int | None = 1) -> ClientApp:
    """A ClientApp training privkit's local solver on client ``partition-id`` of a data set.

    Unset arguments come from the run config (``dataset``, ``seed``, ``num-clients``,
    ``model``; defaults ``synthetic:0.5,0.5``, 0, all clients, ``logreg``), so one app serves
    ``flwr run`` (run config from the app's pyproject) and ``run_simulation`` (arguments).

    Args:
        mods: client mods applied to every message (e.g. output perturbation).
        train_actions: more train functions, ``{action: mods}``: the same training behind
            message type ``train.<action>`` with these function-specific mods (a strategy
            picks one with ``train_action``), e.g. ``{"private": [OutputPerturbationMod()]}``
            next to a plain ``train``.
        torch_threads: torch CPU threads per client process (Flower runs one client per CPU).
    """
    app = ClientApp(mods=list(mods))

    def setting(context: Context, name: str, given: Any, default: Any) -> Any:
        return given if given is not None else context.run_config.get(name, default)

    def client_data(context: Context) -> tuple[Any, FederatedDataset, int]:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        ds = load_federated(str(setting(context, "dataset", dataset, "synthetic:0.5,0.5")),
                            int(setting(context, "seed", seed, 0)),
                            setting(context, "num-clients", num_clients, None))
        cid = partition_id(context)
        if cid >= ds.num_clients:
            raise InvalidParameterError("partition-id", cid, f"< {ds.num_clients} clients")
        return make_model(str(setting(context, "model", model, "logreg")), ds), ds, cid

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        _, ds, cid = client_data(context)
        return roster_reply(msg, client=cid, num_examples=int(ds.train_sizes[cid]))

    def train(msg: Message, context: Context) -> Message:
        net, ds, cid = client_data(context)
        data = _client_split(ds, cid, Split.TRAIN)
        config = msg.content.config_records[keys.CONFIG]
        w_bar = keys.to_torch(msg.content.array_records[keys.ARRAYS])
        lin = (keys.to_torch(msg.content.array_records[keys.LINEAR_TERM])
               if keys.LINEAR_TERM in msg.content.array_records else None)
        dpsgd = dpsgd_request(msg)
        new = local_update(net, w_bar, data, config, client=cid, linear_term=lin, dpsgd=dpsgd)
        metrics: dict[str, Any] = {keys.NUM_EXAMPLES: int(ds.train_sizes[cid])}
        if lin is not None:
            metrics[keys.LINEAR_TERM_USED] = 1
        if dpsgd is not None:
            metrics[keys.DPSGD_STEPS] = int(steps_per_client(
                [int(ds.train_sizes[cid])], [int(config[keys.LOCAL_EPOCHS])],
                dpsgd.batch_size)[0])
        return Message(RecordDict({keys.ARRAYS: keys.to_record(new),
                                   keys.METRICS: MetricRecord(metrics)}), reply_to=msg)

    app.train()(train)
    for action, action_mods in (train_actions or {}).items():
        app.train(action, mods=list(action_mods))(train)

    @app.evaluate()
    def evaluate_(msg: Message, context: Context) -> Message:
        net, ds, cid = client_data(context)
        n = int(ds.test_sizes[cid])
        metrics: dict[str, Any] = {keys.NUM_EXAMPLES: n, "loss": 0.0, "accuracy": 0.0}
        if n > 0:
            w = keys.to_torch(msg.content.array_records[keys.ARRAYS])
            loss, acc = evaluate(net, w, _client_split(ds, cid, Split.TEST))
            metrics.update(loss=loss, accuracy=acc)
        return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)

    return app


def _client_split(ds: FederatedDataset, cid: int, split: Split) -> ClientData:
    return to_client_data(ds.padded(split, clients=[cid]), torch.device("cpu"), torch.float32)

