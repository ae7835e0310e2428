"""privkit.torch's ghost path for nn.MultiheadAttention and the Transformer layers: the
decomposed forward equals the module's own (every option), and per-example norms and clipped
sums equal a per-example autograd loop on the real modules (self-, encoder-decoder and
cross-attention with separate weights, masks, bias_k/bias_v, zero attention, an attention
module called twice, attention weights in the loss, dropout with the same draws), under both
routes; K clients batched equal their one-at-a-time reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import privkit.torch as pt
from privkit.errors import InvalidParameterError
from privkit.torch import _layers
from privkit.torch._attention import mha_forward, proxies

GHOST, FUNC = pt.GradMethod.GHOST, pt.GradMethod.FUNC
D = torch.float64


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


# ------------------------------------------------------------------ the decomposed forward
def _mha(**kw):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, **kw).to(D)
    with torch.no_grad():  # non-zero biases, so that a misplaced bias shows
        for n, p in m.named_parameters():
            if "bias" in n:
                p.copy_(_randn(*p.shape, seed=len(n)))
    return m


FORWARDS = {
    "self": (dict(batch_first=True), "self", {}),
    "self, sequence first": (dict(), "self", {}),
    "encoder-decoder": (dict(batch_first=True), "kv", {}),
    "all distinct": (dict(batch_first=True), "qkv", {}),
    "weights per head": (dict(batch_first=True), "self",
                         dict(need_weights=True, average_attn_weights=False)),
    "float mask": (dict(batch_first=True), "kv", dict(attn_mask=_randn(4, 6, seed=3))),
    "bool mask and padding": (dict(batch_first=True), "kv", dict(
        attn_mask=torch.zeros(4, 6, dtype=torch.bool).fill_diagonal_(True),
        key_padding_mask=torch.tensor([[False] * 5 + [True], [False] * 6, [True] + [False] * 5]))),
    "3-d mask": (dict(batch_first=True), "kv", dict(attn_mask=_randn(6, 4, 6, seed=4),
                                                    need_weights=False)),
    "causal": (dict(batch_first=True), "self", dict(
        attn_mask=nn.Transformer.generate_square_subsequent_mask(4, dtype=D),
        is_causal=True, need_weights=False)),
    "causal with weights": (dict(batch_first=True), "self", dict(
        attn_mask=nn.Transformer.generate_square_subsequent_mask(4, dtype=D), is_causal=True)),
    "bias_kv and zero attention": (dict(add_bias_kv=True, add_zero_attn=True), "kv", dict(
        key_padding_mask=torch.tensor([[False] * 5 + [True], [False] * 6, [True] + [False] * 5]),
        attn_mask=_randn(4, 6, seed=5) > 1)),
    "separate weights": (dict(kdim=5, vdim=3, batch_first=True), "qkv", {}),
    "no bias": (dict(bias=False, batch_first=True), "self", dict(need_weights=False)),
}


def _inputs(kind, batch_first, kdim=8, vdim=8, b=3, t=4, s=6):
    q = _randn(b, t, 8, seed=10)
    if kind == "self":
        k = v = q
    elif kind == "kv":
        k = v = _randn(b, s, 8, seed=11)
    else:
        k, v = _randn(b, s, kdim, seed=11), _randn(b, s, vdim, seed=12)
    if not batch_first:
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        if kind == "self":
            k = v = q
        elif kind == "kv":
            v = k
    return q, k, v


@pytest.mark.parametrize("case", sorted(FORWARDS))
def test_the_decomposed_forward_equals_the_modules_own(case):
    kw, kind, call = FORWARDS[case]
    m = _mha(**kw)
    q, k, v = _inputs(kind, m.batch_first, m.kdim, m.vdim, t=6 if kind == "self" and
                      "causal" not in case and "mask" in case else 4)
    want = m(q, k, v, **call)
    got = mha_forward(m, *proxies(m), q, k, v, **call)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert got[0].stride() == want[0].stride()  # laid out alike: later draws alike
    if want[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


def test_unbatched_attention_is_refused_by_name():
    m = _mha(batch_first=True)
    x = _randn(4, 8)
    with pytest.raises(InvalidParameterError, match="query.*batched.*GradMethod.FUNC"):
        mha_forward(m, *proxies(m), x, x, x)


# ------------------------------------------------------------------ per-example gradients
class Pool(nn.Module):
    def forward(self, x):
        return x.mean(1)


class Encoder(nn.Module):
    """Two encoder layers (batch first) with a key padding mask given per example."""

    def __init__(self, causal=False):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)
        self.causal = causal

    def forward(self, x, pad):
        h = self.inp(x)
        if self.causal:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=h.dtype)
            return self.head(self.enc(h, mask=mask, is_causal=True).mean(1))
        return self.head(self.enc(h, src_key_padding_mask=pad).mean(1))


class Decoder(nn.Module):
    """A decoder layer: self-attention, and encoder-decoder attention on a memory."""

    def __init__(self):
        super().__init__()
        self.tgt, self.mem = nn.Linear(4, 8), nn.Linear(4, 8)
        self.dec = nn.TransformerDecoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                              batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x, pad):
        return self.head(self.dec(self.tgt(x), self.mem(x.flip(1)),
                                  memory_key_padding_mask=pad).mean(1))


class Exotic(nn.Module):
    """Sequence-first attention with separate key/value widths, bias_k/bias_v and zero
    attention; a packed attention called twice, as self-attention and on another input
    (blocks of mixed arity), its weights in the loss."""

    def __init__(self):
        super().__init__()
        self.k, self.v = nn.Linear(4, 5), nn.Linear(4, 3)
        self.att = nn.MultiheadAttention(4, 2, kdim=5, vdim=3, add_bias_kv=True,
                                         add_zero_attn=True)
        self.twice = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x, pad):
        xs, ks, vs = (t.transpose(0, 1) for t in (x, self.k(x), self.v(x)))
        h = self.att(xs, ks, vs, key_padding_mask=pad)[0].transpose(0, 1)
        h2, w = self.twice(h, h, h, average_attn_weights=False)
        h3 = self.twice(h2, x, x, need_weights=False)[0]
        return self.head(h3.mean(1)) + w.mean((1, 2, 3))[:, None]


MODELS = {"encoder": Encoder, "causal encoder": lambda: Encoder(causal=True),
          "decoder": Decoder, "exotic": Exotic}
X = _randn(5, 6, 4, seed=20)
PAD = torch.zeros(5, 6, dtype=torch.bool)
PAD[1, 4:] = True
PAD[3, 0] = True
Y = torch.tensor([0, 1, 2, 1, 0])


def _model(name):
    torch.manual_seed(1)
    net = MODELS[name]().to(D)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "bias" in n:
                p.add_(0.1 * _randn(*p.shape, seed=len(n)))
    return net


def _loop(net, inputs, y):
    out = {n: [] for n, _ in net.named_parameters()}
    for i in range(y.shape[0]):
        net.zero_grad()
        F.cross_entropy(net(*(t[i:i + 1] for t in inputs)), y[i:i + 1]).backward()
        for n, p in net.named_parameters():
            out[n].append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
    return {n: torch.stack(v) for n, v in out.items()}


def _norms(per):
    return torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in per.values()))


@pytest.mark.parametrize("route", [None, "ghost", "materialise"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_norms_and_clipped_sums_equal_the_loop(name, route, monkeypatch):
    monkeypatch.setattr(_layers, "ROUTE", route)
    net = _model(name)
    loop = _loop(net, (X, PAD), Y)
    norms = _norms(loop)
    clip = float(norms.median())
    s = pt.clipped_grad_sum(net, (X, PAD), Y, l2_clip_norm=clip)
    torch.testing.assert_close(s.norms, norms, rtol=1e-10, atol=1e-12)
    f = pt.clip_factors(norms, clip, D)
    assert list(s.grads) == list(loop)
    for n, v in loop.items():
        torch.testing.assert_close(s.grads[n], torch.einsum("b,b...->...", f, v),
                                   rtol=1e-10, atol=1e-12)


def test_float32_transformer_matches_the_loop_to_1e_6():
    torch.manual_seed(2)
    net = Encoder().float()
    x = X.float()
    loop = _loop(net, (x, PAD), Y)
    norms = _norms(loop).double()
    s = pt.clipped_grad_sum(net, (x, PAD), Y, l2_clip_norm=float(norms.median()))
    torch.testing.assert_close(s.norms, norms, rtol=1e-6, atol=1e-7)
    f = pt.clip_factors(norms, float(norms.median()), torch.float32).float()
    for n, v in loop.items():
        torch.testing.assert_close(s.grads[n], torch.einsum("b,b...->...", f, v),
                                   rtol=1e-5, atol=1e-6)


def test_dropout_draws_are_those_of_the_modules_own_forward():
    # with the same seed, the decomposed forward draws the same dropout masks as the real
    # model: the per-example gradients of that one random forward, by autograd per row
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.3, batch_first=True)
    net = nn.Sequential(nn.Linear(4, 8), layer, Pool(), nn.Linear(8, 3)).to(D)
    torch.manual_seed(7)
    losses = F.cross_entropy(net(X), Y, reduction="none")
    params = [p for _, p in net.named_parameters()]
    rows = [torch.autograd.grad(losses[i], params, retain_graph=True) for i in range(5)]
    norms = torch.sqrt(torch.stack([sum(g.pow(2).sum() for g in r) for r in rows]))
    torch.manual_seed(7)
    got = pt.per_example_norms(net, X, Y)
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)


def test_each_example_moves_the_clipped_sum_by_at_most_c():
    net = _model("exotic")
    clip = 0.05
    full = pt.clipped_grad_sum(net, (X, PAD), Y, l2_clip_norm=clip).grads
    for i in range(5):
        keep = torch.arange(5) != i
        part = pt.clipped_grad_sum(net, (X[keep], PAD[keep]), Y[keep], l2_clip_norm=clip).grads
        diff = torch.cat([(full[n] - part[n]).reshape(-1) for n in full])
        assert float(torch.linalg.vector_norm(diff)) <= clip


class SeqFirst(nn.Module):
    """nn.TransformerEncoderLayer(batch_first=False), the default: its linear and
    normalisation layers see (T, B, E) tensors."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0)

    def forward(self, x):
        return self.head(self.layer(self.inp(x).transpose(0, 1)).mean(0))


@pytest.mark.parametrize("b,t", [(5, 6), (5, 5), (1, 6), (6, 1)])
def test_sequence_first_layers_get_their_batch_dimension_right(b, t):
    # the batch is on dimension 1 of the encoder layer's linear and norm layers; a forward at
    # another batch size says so, also where the sequence is as long as the batch (5, 5), for
    # one example (1, 6) and for sequences of one position (6, 1)
    torch.manual_seed(0)
    net = SeqFirst().to(D)
    x, y = _randn(b, t, 4, seed=8), torch.arange(b) % 3
    loop = _loop(net, (x,), y)
    norms = _norms(loop)
    s = pt.clipped_grad_sum(net, x, y, l2_clip_norm=float(norms.median()))
    torch.testing.assert_close(s.norms, norms, rtol=1e-10, atol=1e-12)
    f = pt.clip_factors(norms, float(norms.median()), D)
    for n, v in loop.items():
        torch.testing.assert_close(s.grads[n], torch.einsum("b,b...->...", f, v),
                                   rtol=1e-10, atol=1e-12)


def test_a_batch_second_layer_without_a_position_wise_rule_is_refused_by_name():
    class Grouped(nn.Module):  # GroupNorm on (T, B, E), one group per example: its rule
        def __init__(self):  # needs the batch on dimension 0
            super().__init__()
            self.norm, self.head = nn.GroupNorm(5, 5), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.norm(x.transpose(0, 1)).mean(0))

    class Positions(nn.Module):  # an output shared by every example: no batch dimension
        def __init__(self):
            super().__init__()
            self.pos, self.head = nn.Embedding(6, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.head((x + self.pos(torch.arange(x.shape[1]))).mean(1))

    torch.manual_seed(0)
    x = _randn(5, 6, 4, seed=8)
    with pytest.raises(InvalidParameterError, match="'norm'.*dimension 0"):
        pt.per_example_norms(Grouped().to(D), x, Y)
    pos = Positions().to(D)
    with pytest.raises(InvalidParameterError, match="'pos'.*dimension 0"):
        pt.per_example_norms(pos, x, Y)
    torch.testing.assert_close(pt.per_example_norms(pos, x, Y, method=FUNC),
                               _norms(_loop(pos, (x,), Y)), rtol=1e-10, atol=1e-12)


def test_the_clients_refuse_a_sequence_first_layer_by_name():
    torch.manual_seed(0)
    net = SeqFirst().to(D)
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.8)
    params = {nm: p.detach().expand(2, *p.shape).clone() for nm, p in net.named_parameters()}
    data = pt.ClientBatch(_randn(2, 4, 6, 4, seed=1), torch.zeros(2, 4, dtype=torch.long),
                          torch.tensor([4, 3]))
    with pytest.raises(InvalidParameterError, match="'layer.linear1'.*dimension 0"):
        dp.run(params, data, steps=torch.tensor([1, 1]), sampling_rates=[0.5, 0.5],
               client_keys=[0, 1], rng=pt.ClientStreams(seed=0), update=pt.LocalSgd(lr=0.1))


# ------------------------------------------------------------------ K clients
@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("method", [GHOST, FUNC])
def test_batched_clients_train_a_transformer_as_the_loop(method):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0, batch_first=True)
    net = nn.Sequential(nn.Embedding(9, 4), layer, Pool(), nn.Linear(4, 3)).to(D)
    k, n = 3, 8
    g = torch.Generator().manual_seed(1)
    sizes = torch.tensor([8, 5, 6])
    data = pt.ClientBatch(torch.randint(0, 9, (k, n, 5), generator=g),
                          torch.randint(0, 3, (k, n), generator=g), sizes)
    params = {nm: p.detach().expand(k, *p.shape).clone() for nm, p in net.named_parameters()}
    dp = pt.ClientsDpSgd(net, l2_clip_norm=0.3, noise_multiplier=0.8, method=method)
    kw = dict(steps=torch.tensor([3, 2, 4]), sampling_rates=pt.sampling_rates(sizes, 3),
              client_keys=[1, 2, 3], rng=pt.ClientStreams(seed=4), update=pt.LocalSgd(lr=0.2))
    a, b = dp.run(params, data, **kw), dp.reference_run(params, data, **kw)
    for nm in a:
        torch.testing.assert_close(a[nm], b[nm], rtol=1e-10, atol=1e-12)
    assert not torch.equal(a["1.self_attn.in_proj_weight"], params["1.self_attn.in_proj_weight"])
