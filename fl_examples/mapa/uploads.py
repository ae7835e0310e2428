"""How MAPA's edges compute their noisy uploads: the batched path and the reference path.

An upload of edge k is the mean over b of its batch's per-example gradients, each clipped to
``C = b DeltaS / 2``, plus the noise of :class:`~privkit.mechanisms.LaplaceGradientNoise` at
eps_k. Every random draw comes from a stream keyed by (seed, edge, upload): the batch
(:data:`_TAG_BATCH`) and the noise (:data:`_TAG_NOISE`), so a resumed run draws what an
uninterrupted one does. The batched path computes every pending upload of a flush together and
adds each one's noise with the samplers below (the same release as the mechanism's
``__call__``, which the reference path, ``batched=False``, calls one upload at a time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fl_examples.core.data import FederatedDataset, Split
from fl_examples.mapa.schedule import _mechanism
from privkit._rng import SecureRandom
from privkit.mechanisms import (
    NoiseShape,
    clip_per_example,
    gaussian_noise,
    l2_laplace_noise,
    laplace_noise,
)

__all__: list[str] = []

# spawn-key tags of the per-upload random streams (part of the reproducibility contract)
_TAG_BATCH = 7101


_TAG_NOISE = 7102


_TAG_INIT = 7103


_CHUNK_ROWS = 1 << 14  # per-example rows (jobs x b) per gradient chunk


def _stream(seed: int, tag: int, edge: int, upload: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(tag, edge, upload)))


@dataclass
class _Data:
    """Pooled training data (edge k owns rows offsets[k] .. offsets[k] + sizes[k] - 1)."""

    x: Tensor
    y: Tensor
    x_test: Tensor
    y_test: Tensor
    offsets: np.ndarray
    sizes: np.ndarray
    x_heldout: Tensor | None = None
    y_heldout: Tensor | None = None


def _pool(ds: FederatedDataset, device: torch.device) -> _Data:
    x, y = ds.pooled(Split.TRAIN)
    xt, yt = ds.pooled(Split.TEST)
    sizes = ds.train_sizes
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    held = (None, None) if ds.x_heldout is None else (
        torch.as_tensor(ds.x_heldout, dtype=torch.float32, device=device),
        torch.as_tensor(ds.y_heldout, dtype=torch.long, device=device))
    return _Data(torch.as_tensor(x, dtype=torch.float32, device=device),
                 torch.as_tensor(y, dtype=torch.long, device=device),
                 torch.as_tensor(xt, dtype=torch.float32, device=device),
                 torch.as_tensor(yt, dtype=torch.long, device=device), offsets, sizes, *held)


@torch.no_grad()
def _evaluate(model: Any, flat: Tensor, x: Tensor, y: Tensor, chunk: int = 8192
              ) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of one model over (x, y)."""
    if len(y) == 0:
        return float("nan"), float("nan")
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, len(y), chunk):
        logits = model.flat_logits(flat, x[s:s + chunk])
        loss += F.cross_entropy(logits, y[s:s + chunk], reduction="sum").double()
        correct += (logits.argmax(-1) == y[s:s + chunk]).sum().double()
    return float(loss) / len(y), float(correct) / len(y)


class UploadsMixin:
    """The upload computation of a MAPA run (mixed into :class:`fl_examples.mapa.run._Run`).

    It uses the run's configuration, data, model, the edges' state (``pulled`` models,
    ``grads``, ``ready`` flags, ``next_upload`` numbers, ``delta_s`` of each pending job) and
    its charging (``_charge``, before any noise is drawn).
    """

    cfg: Any
    data: Any
    model: Any
    device: Any
    dim: int
    private: bool
    eps: np.ndarray
    q: np.ndarray
    z: float | None
    x: Tensor
    pulled: Tensor
    grads: Tensor
    ready: np.ndarray
    next_upload: np.ndarray
    delta_s: np.ndarray
    applied: int
    flushes: int
    compute: float
    canaries: Any  # the audit's TrainerCanaries (--audit-canaries), or None
    audit_edge: int | None

    # and the run's ``_charge(edges)``, ``_will_apply(k)`` and ``_delta_s_for(version)``

    def _rng(self, tag: int, k: int, u: int) -> Any:
        """The stream of upload u of edge k: keyed by (seed, edge, upload), or the OS CSPRNG
        (:class:`privkit.SecureRandom`) for a private run with ``secure_noise``."""
        if self.cfg.secure_noise and self.private:
            return SecureRandom()
        return _stream(self.cfg.seed, tag, k, u)

    def _batch_rows(self, k: int, u: int) -> np.ndarray:
        """Rows (into the pooled data) of upload u of edge k: b distinct records, or a Poisson
        sample keeping each of the edge's n_k records with probability q_k = b / n_k."""
        n = int(self.data.sizes[k])
        rng = self._rng(_TAG_BATCH, k, u)
        uniforms = np.asarray(rng.uniform(n) if isinstance(rng, SecureRandom)
                              else rng.random(n)) if (
            self.cfg.batch_sampler == "poisson" or isinstance(rng, SecureRandom)) else None
        if self.cfg.batch_sampler == "poisson":
            rows = np.flatnonzero(uniforms < self.q[k])
        elif uniforms is not None:  # b distinct records: the b smallest of n uniforms
            rows = np.argsort(uniforms, kind="stable")[: self.cfg.batch]
        else:
            rows = rng.choice(n, self.cfg.batch, replace=False)
        return rows + int(self.data.offsets[k])

    def _rows(self, ks: list[int], ups: list[int]) -> tuple[Tensor, Tensor | None]:
        """(jobs, rows) indices of the jobs' batches, and for Poisson batches the 0/1 mask of
        real rows (shorter batches are padded with the edge's first record, masked out)."""
        idx = [self._batch_rows(k, u) for k, u in zip(ks, ups)]
        if self.cfg.batch_sampler != "poisson":
            return torch.as_tensor(np.stack(idx), device=self.device), None
        width = max(1, max(len(r) for r in idx))
        rows = np.empty((len(ks), width), dtype=np.int64)
        mask = np.zeros((len(ks), width), dtype=bool)
        for i, (k, r) in enumerate(zip(ks, idx)):
            rows[i] = int(self.data.offsets[k])
            rows[i, :len(r)] = r
            mask[i, :len(r)] = True
        return (torch.as_tensor(rows, device=self.device),
                torch.as_tensor(mask, device=self.device))

    def _compute(self, edges: list[int]) -> None:
        """Noisy uploads of the pending jobs of ``edges`` into ``self.grads`` (charged first)."""
        t0 = time.perf_counter()
        self._charge(edges)
        b = self.cfg.batch
        per_chunk = max(1, _CHUNK_ROWS // (b * max(1, self.dim // 1024)))
        for s in range(0, len(edges), per_chunk):
            ks = edges[s:s + per_chunk]
            ups = [int(self.next_upload[k]) for k in ks]
            rows, mask = self._rows(ks, ups)
            xb, yb = self.data.x[rows], self.data.y[rows]
            params = self.pulled[ks]
            if not self.private:
                self.grads[ks] = self.model.mean_grads(params, xb, yb) if mask is None \
                    else self.model.mean_grads(params, xb, yb, mask, b)
                continue
            per_ex = self.model.per_example_grads(params, xb, yb)
            if self.cfg.batched or mask is not None:
                # (the naive path computes one job per call, so a Poisson job is alone here;
                # LaplaceGradientNoise needs exactly b rows, a Poisson batch has any number)
                self.grads[ks] = self._noisy_batched(per_ex, ks, ups, mask)
            else:
                for i, (k, u) in enumerate(zip(ks, ups)):
                    mech = _mechanism(float(self.delta_s[k]), b, float(self.eps[k]),
                                      self.cfg.noise)
                    self.grads[k] = mech(per_ex[i], rng=self._rng(_TAG_NOISE, k, u))
        self.ready[edges] = True
        self.compute += time.perf_counter() - t0

    def _noisy_batched(self, per_ex: Tensor, ks: list[int], ups: list[int],
                       mask: Tensor | None = None) -> Tensor:
        """The same release as ``LaplaceGradientNoise.__call__`` per job, clipped in groups.

        Rows are clipped to C = b DeltaS / 2, summed (those with ``mask`` 1) and divided by
        the configured b, whatever the number of rows; then each job's noise is added.
        """
        m, width, d = per_ex.shape
        b = self.cfg.batch
        flat = per_ex.reshape(m * width, d)
        clipped = torch.empty_like(flat)
        ds = self.delta_s[ks]
        for value in np.unique(ds):
            sel = np.flatnonzero(ds == value)
            rows = torch.as_tensor((sel[:, None] * width + np.arange(width)).ravel(),
                                   device=flat.device)
            clipped[rows] = clip_per_example(flat[rows], b * float(value) / 2.0)
        per = clipped.view(m, width, d).double()
        if mask is not None:
            per = per * mask[:, :, None].to(per.dtype)
        mean64 = per.sum(1) / b
        planted = self._plant(per, mean64, ks, ds) if self.canaries is not None else None
        noise = np.empty((m, d))
        for i, (k, u) in enumerate(zip(ks, ups)):
            rng = self._rng(_TAG_NOISE, k, u)
            if self.cfg.noise == "gaussian":  # N(0, (z C)^2 I) on the clipped sum, then / b
                clip = b * float(ds[i]) / 2.0
                noise[i] = gaussian_noise(noise[i], self.z * clip, rng=rng) / b
                continue
            mech = _mechanism(float(ds[i]), b, float(self.eps[k]), self.cfg.noise)
            if mech.shape is NoiseShape.L2:
                noise[i] = l2_laplace_noise(noise[i], mech.alpha, rng=rng)
            else:
                noise[i] = laplace_noise(noise[i], mech.l1_sensitivity(d) / mech.epsilon, rng=rng)
        out = (mean64 + torch.from_numpy(noise).to(mean64.device)).float()
        if planted is not None:  # the audit scores the released upload's noisy sum
            assert self.canaries is not None
            self.canaries.observe(out[planted].double().cpu().numpy() * b)
        return out

    def _plant(self, per: Tensor, mean64: Tensor, ks: list[int], ds: np.ndarray) -> int | None:
        """The audit's canary records in the audited edge's upload, if it is among ``ks``:
        each canary taking part is one more per-example gradient (norm 2 C), clipped to C
        like the others and added to the sum before the noise (in place on ``mean64``);
        returns the job's index."""
        assert self.canaries is not None
        if self.audit_edge not in ks:
            return None
        i = ks.index(self.audit_edge)
        clip = self.cfg.batch * float(ds[i]) / 2.0
        take = self.canaries.begin(self.canaries.releases + 1, clip)
        if take.any():
            rows = torch.from_numpy(self.canaries.rows(take, clip)).to(per.device)
            mean64[i] += clip_per_example(rows, clip).sum(0) / self.cfg.batch
        return i

    def _flush(self) -> None:
        """Compute every pending upload that this run will make (batched path)."""
        pending = [k for k in np.flatnonzero(~self.ready).tolist() if self._will_apply(k)]
        self.flushes += 1
        self._compute(pending)

    def _pull(self, k: int) -> None:
        """Edge k receives the current model (and DeltaS) and starts its next upload."""
        self.pulled[k] = self.x
        self.next_upload[k] += 1
        self.ready[k] = False
        self.delta_s[k] = self._delta_s_for(self.applied)
        if not self.cfg.batched and self._will_apply(k):
            self._compute([k])
