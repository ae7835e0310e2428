"""privkit.torch.grads: per-example gradients, ghost norms and clipped sums against a
per-example autograd loop (float64), clipping's sensitivity bound (with a mutant that breaks
it), refused layers and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import privkit.torch as pt
from privkit.errors import InvalidParameterError
from privkit.torch import _layers

GHOST, FUNC = pt.GradMethod.GHOST, pt.GradMethod.FUNC


class Scaled(nn.Module):
    """A layer with its own parameter and a child: on the torch.func fallback path."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))
        self.inner = nn.Linear(5, 4)

    def forward(self, x):
        return self.inner(torch.tanh(x * self.scale))


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)).mean(1))


class Pool(nn.Module):
    def forward(self, x):
        return x.mean(1)


class Twice(nn.Module):
    """One Linear called twice per forward (shared weights inside one module's calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.lin(torch.relu(self.lin(x))))


def _cases():
    g = torch.Generator().manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    cases = {
        "mlp": (lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)),
                randn(7, 4)),
        "cnn": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4),
                                      nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2, padding=1),
                                      nn.Flatten(), nn.Linear(45, 3)), randn(7, 2, 6, 6)),
        "conv1d": (lambda: nn.Sequential(
            nn.Conv1d(3, 4, 3, padding="same", padding_mode="reflect"), nn.ReLU(),
            nn.Conv1d(4, 2, 2, dilation=2), nn.Flatten(), nn.Linear(12, 3)), randn(7, 3, 8)),
        "grouped_conv3d": (lambda: nn.Sequential(
            nn.Conv2d(4, 4, 3, groups=2, padding=1, bias=False), nn.Unflatten(1, (1, 4)),
            nn.Conv3d(1, 2, 2), nn.Flatten(), nn.Linear(2 * 3 * 3 * 3, 3)), randn(7, 4, 4, 4)),
        "embedding": (TokenModel, torch.randint(0, 11, (7, 5), generator=g)),
        "custom": (lambda: nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(4, 3)), randn(7, 5)),
        "sequence": (lambda: nn.Sequential(nn.Linear(4, 3), nn.Flatten(), nn.Linear(15, 3)),
                     randn(7, 5, 4)),
        "wide": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Flatten(), nn.Linear(24, 3)),
                 randn(7, 3, 8)),
        "twice": (Twice, randn(7, 4)),
        # a convolution whose per-example gradients (8 * 36) outweigh its input and output
        # gradients (4 * 9 + 8): not kept
        "deepconv": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3),
                                           nn.Flatten(), nn.Linear(8, 3)), randn(7, 3, 5, 5)),
        "transformer": (lambda: nn.Sequential(
            nn.Linear(4, 8), nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                                        batch_first=True),
            Pool(), nn.Linear(8, 3)), randn(7, 5, 4)),
    }
    if hasattr(nn, "RMSNorm"):
        cases["rmsnorm"] = (lambda: nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6),
                                                  nn.Linear(6, 3)), randn(7, 4))
    return cases


CASES = _cases()
Y = torch.tensor([0, 1, 2, 1, 0, 2, 1])


def _model(name):
    torch.manual_seed(1)
    make, x = CASES[name]
    return make().to(torch.float64), x


def _loop(module, x, y):
    """Per-example gradients by plain autograd, one example at a time."""
    out = {n: [] for n, _ in module.named_parameters()}
    for i in range(x.shape[0]):
        module.zero_grad()
        F.cross_entropy(module(x[i:i + 1]), y[i:i + 1]).backward()
        for n, p in module.named_parameters():
            out[n].append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
    return {n: torch.stack(v) for n, v in out.items()}


def _norms(per):
    return torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in per.values()))


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_example_grads_equal_an_autograd_loop(name):
    module, x = _model(name)
    loop = _loop(module, x, Y)
    got = pt.per_example_grads(module, x, Y)
    assert list(got) == list(loop)
    for n in loop:
        torch.testing.assert_close(got[n], loop[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", [GHOST, FUNC])
@pytest.mark.parametrize("name", sorted(CASES))
def test_norms_and_clipped_sums_equal_the_loop(name, method):
    module, x = _model(name)
    loop = _loop(module, x, Y)
    norms = _norms(loop)
    torch.testing.assert_close(pt.per_example_norms(module, x, Y, method=method), norms,
                               rtol=1e-10, atol=1e-12)
    clip = float(norms.median())  # some examples clipped, some not
    s = pt.clipped_grad_sum(module, x, Y, l2_clip_norm=clip, method=method)
    f = pt.clip_factors(norms, clip, torch.float64)
    for n, v in loop.items():
        torch.testing.assert_close(s.grads[n], torch.einsum("b,b...->...", f, v),
                                   rtol=1e-10, atol=1e-12)


ROUTED = ["wide", "sequence", "cnn", "conv1d", "twice", "deepconv", "transformer"]


@pytest.mark.parametrize("route,patches,chunk", [
    ("ghost", 32, 1 << 18), ("materialise", 32, 1 << 18), ("materialise", 0, 1 << 18),
    ("materialise", 10**6, 1), ("materialise", 0, 1), ("ghost", 32, 1), (None, 0, 1)])
@pytest.mark.parametrize("name", ROUTED)
def test_every_route_gives_the_loops_norms_and_clipped_sums(name, route, patches, chunk,
                                                          monkeypatch):
    # Gram matrices (ghost norms) or materialised per-example gradients, the latter from
    # patches or from a grouped convolution, in chunks of 1 example or of many: all exact
    monkeypatch.setattr(_layers, "ROUTE", route)
    monkeypatch.setattr(_layers, "PATCH_ENTRIES", patches)
    monkeypatch.setattr(_layers, "PATCH_ELEMENTS", patches)
    monkeypatch.setattr(_layers, "CHUNK_ELEMENTS", chunk)
    module, x = _model(name)
    loop = _loop(module, x, Y)
    norms = _norms(loop)
    clip = float(norms.median())
    s = pt.clipped_grad_sum(module, x, Y, l2_clip_norm=clip)
    torch.testing.assert_close(s.norms, norms, rtol=1e-10, atol=1e-12)
    f = pt.clip_factors(norms, clip, torch.float64)
    for n, v in loop.items():
        torch.testing.assert_close(s.grads[n], torch.einsum("b,b...->...", f, v),
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,grams", [
    ("wide", []),  # Linear(8, 8) on 3 positions: 2 * 3 * 16 = 96 >= 64, materialised
    ("cnn", []),  # the stride-2 conv: 9 positions, 36 inputs, 5 outputs: 2 * 9 * 41 >= 180
    ("sequence", []),  # Linear(4, 3) on 5 positions
    ("long", [(7, 2, 48)]),  # Linear(48, 40) on 2 positions: 2 * 2 * 88 = 352 < 1920
])
def test_each_layer_takes_the_cheaper_route(name, grams, monkeypatch):
    seen = []
    real = _layers._gram_norms
    monkeypatch.setattr(_layers, "_gram_norms",
                        lambda a, g: seen.append(tuple(a.shape)) or real(a, g))
    if name == "long":
        torch.manual_seed(1)
        module = nn.Sequential(nn.Linear(48, 40), nn.Flatten(), nn.Linear(80, 3)).double()
        x = torch.randn(7, 2, 48, dtype=torch.float64)
    else:
        module, x = _model(name)
    pt.per_example_norms(module, x, Y)
    assert seen == grams
    assert _layers.ghost_route(2, 40, 48) and not _layers.ghost_route(3, 8, 8)
    seen.clear()
    monkeypatch.setattr(_layers, "ROUTE", "materialise")
    pt.per_example_norms(module, x, Y)
    assert seen == []
    monkeypatch.setattr(_layers, "ROUTE", "ghost")
    pt.per_example_norms(module, x, Y)
    assert len(seen) == {"wide": 1, "cnn": 2, "sequence": 1, "long": 1}[name]


# ------------------------------------------------------------------ clipping's sensitivity
def _sensitivity(clipped_sum, module, x, y, clip):
    """max over i of ||S(X) - S(X without i)||: the L2 sensitivity under add/remove."""
    def flat(s):
        return torch.cat([v.reshape(-1) for v in s.values()])

    full = flat(clipped_sum(module, x, y, clip))
    out = []
    for i in range(x.shape[0]):
        keep = torch.arange(x.shape[0]) != i
        out.append(float(torch.linalg.vector_norm(full - flat(
            clipped_sum(module, x[keep], y[keep], clip)))))
    return max(out)


def _privkit(method):
    def f(module, x, y, clip):
        return pt.clipped_grad_sum(module, x, y, l2_clip_norm=clip, method=method).grads
    return f


def _batch_mean_clipping(module, x, y, clip):
    """The mutant: clip the batch's mean gradient, then scale it back up to a sum."""
    module.zero_grad()
    F.cross_entropy(module(x), y).backward()
    g = {n: p.grad.clone() for n, p in module.named_parameters()}
    norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
    f = min(1.0, clip / float(norm))
    return {n: v * f * x.shape[0] for n, v in g.items()}


@pytest.mark.parametrize("method", [GHOST, FUNC])
@pytest.mark.parametrize("name", ["mlp", "cnn", "embedding", "custom", "transformer"])
def test_each_example_moves_the_clipped_sum_by_at_most_c(name, method):
    module, x = _model(name)
    clip = 0.05  # every example is clipped: the bound is tight
    assert _sensitivity(_privkit(method), module, x, Y, clip) <= clip


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_batch_mean_clipping_mutant_breaks_the_bound(name):
    module, x = _model(name)
    assert _sensitivity(_batch_mean_clipping, module, x, Y, 0.05) > 1.5 * 0.05


def test_clipped_contribution_is_at_most_c_in_float32():
    torch.manual_seed(3)
    module = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(64, 30) * 50, torch.randint(0, 10, (64,))
    for i in range(8):
        s = pt.clipped_grad_sum(module, x[i:i + 1], y[i:i + 1], l2_clip_norm=1e-3)
        norm = torch.linalg.vector_norm(torch.cat([v.reshape(-1).double()
                                                   for v in s.grads.values()]))
        assert float(norm) <= 1e-3


def test_weights_drop_rows_and_an_empty_batch_gives_zeros():
    module, x = _model("mlp")
    w = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.float64)
    a = pt.clipped_grad_sum(module, x, Y, l2_clip_norm=0.3, weights=w)
    keep = w.bool()
    b = pt.clipped_grad_sum(module, x[keep], Y[keep], l2_clip_norm=0.3)
    for n in a.grads:
        torch.testing.assert_close(a.grads[n], b.grads[n])
    e = pt.clipped_grad_sum(module, x[:0], Y[:0], l2_clip_norm=0.3)
    assert e.norms.shape == (0,) and all(not v.any() for v in e.grads.values())


def test_frozen_parameters_are_left_out():
    module, x = _model("mlp")
    module[0].weight.requires_grad_(False)
    s = pt.clipped_grad_sum(module, x, Y, l2_clip_norm=1.0)
    assert list(s.grads) == ["0.bias", "2.weight", "2.bias"]
    loop = _loop(module, x, Y)
    torch.testing.assert_close(s.norms, _norms({n: loop[n] for n in s.grads}))
    torch.testing.assert_close(pt.per_example_norms(module, x, Y, method=FUNC), s.norms)


def test_a_custom_loss_per_example():
    module, x = _model("mlp")

    def loss(out, y):
        return (out - torch.eye(3, dtype=out.dtype)[y]).pow(2).sum(1)

    a = pt.per_example_norms(module, x, Y, loss_fn=loss)
    b = pt.per_example_norms(module, x, Y, loss_fn=loss, method=FUNC)
    torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ refused layers
def test_batchnorm_is_refused_by_name_and_type_with_its_replacement():
    net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.Sequential(nn.ReLU(), nn.BatchNorm2d(8)))
    for call in (lambda: pt.check_module(net),
                 lambda: pt.clipped_grad_sum(net, torch.randn(2, 1, 5, 5),
                                             torch.tensor([0, 1]), l2_clip_norm=1.0),
                 lambda: pt.ClientsDpSgd(net, l2_clip_norm=1.0, noise_multiplier=1.0)):
        with pytest.raises(InvalidParameterError) as err:
            call()
        msg = str(err.value)
        assert "'1.1'" in msg and "BatchNorm2d" in msg and "nn.GroupNorm(num_groups, 8)" in msg
    net.eval()  # running statistics only: each example on its own
    pt.check_module(net)


@pytest.mark.parametrize("layer,words", [
    (nn.InstanceNorm1d(4, track_running_stats=True), "track_running_stats"),
    (nn.Embedding(5, 4, scale_grad_by_freq=True), "scale_grad_by_freq"),
    (nn.Embedding(5, 4, max_norm=1.0), "max_norm"),
    (nn.SyncBatchNorm(4), "GroupNorm"),
])
def test_other_layers_that_mix_examples_are_refused(layer, words):
    with pytest.raises(InvalidParameterError, match=words) as err:
        pt.check_module(nn.Sequential(nn.Identity(), layer))
    assert type(layer).__name__ in str(err.value) and "'1'" in str(err.value)


def test_shared_parameters_are_refused_by_ghost_and_fine_with_func():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    net[2].weight = net[0].weight
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0])
    with pytest.raises(InvalidParameterError, match="'2.weight'.*GradMethod.FUNC"):
        pt.per_example_norms(net, x, y)
    assert pt.per_example_norms(net, x, y, method=FUNC).shape == (5,)


def test_an_attention_parameter_used_outside_its_module_is_refused_by_ghost():
    # the attention module's out_proj weight, used again by a head (tied): refused by name
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x):
            h = self.att(x, x, x, need_weights=False)[0].mean(1)
            return F.linear(h, self.att.out_proj.weight)[:, :2]

    torch.manual_seed(0)
    net, x, y = Attn(), torch.randn(3, 5, 4), torch.tensor([0, 1, 0])
    with pytest.raises(InvalidParameterError, match="att.out_proj.weight.*GradMethod.FUNC"):
        pt.per_example_norms(net, x, y)
    loop = _loop(net, x, y)
    torch.testing.assert_close(pt.per_example_norms(net, x, y, method=FUNC),
                               _norms(loop).double(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ bad input
def test_bad_input_is_named():
    module, x = _model("mlp")
    with pytest.raises(InvalidParameterError, match="l2_clip_norm.*nan"):
        pt.clipped_grad_sum(module, x, Y, l2_clip_norm=float("nan"))
    with pytest.raises(InvalidParameterError, match=r"loss_fn.*\(7,\)"):
        pt.clipped_grad_sum(module, x, Y, l2_clip_norm=1.0,
                            loss_fn=lambda o, y: F.cross_entropy(o, y))
    with pytest.raises(InvalidParameterError, match="inputs.*batch"):
        pt.per_example_norms(module, x, Y[:3])
    with pytest.raises(InvalidParameterError, match="method"):
        pt.per_example_norms(module, x, Y, method="ghost")
    with pytest.raises(InvalidParameterError, match="weights"):
        pt.clipped_grad_sum(module, x, Y, l2_clip_norm=1.0, weights=torch.ones(3))
    with pytest.raises(InvalidParameterError, match="module"):
        pt.check_module(lambda x: x)


@pytest.mark.parametrize("kw", [dict(kernel_size=3, padding=1), dict(kernel_size=(3, 2), stride=2),
                                dict(kernel_size=2, dilation=2, padding=(1, 0)),
                                dict(kernel_size=3, stride=(1, 2), dilation=(2, 1), padding=2)])
def test_patches_equal_f_unfold(kw):
    conv = nn.Conv2d(3, 4, **kw)
    x = torch.randn(5, 3, 9, 8)
    want = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    assert torch.equal(_layers._unfold(x, conv, conv.padding), want)
