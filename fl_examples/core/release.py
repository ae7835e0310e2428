"""What a private run publishes, and what its epsilon covers (the release accounting).

Every number a private run writes (``report.json``, plots, console, logs) is one of:

* **covered**: computed from what the mechanisms released (the noisy models) and from public
  data only, e.g. the held-out loss and accuracy, or the epsilon itself;
* **public**: computed only from what the run declares public (the settings, the seed when
  the run is seeded, the number of clients N, each client's record count n_i, ...);
* **not covered**: listed in the report under ``privacy.not_covered`` with a one-line
  reason (wall-clock timings, metrics on the clients' own data when asked for, ...).

:class:`Publication` is one run's policy: a private run evaluates on the data set's public
held-out set only (:attr:`~fl_examples.core.dataset.FederatedDataset.x_heldout`, no client's
data), stops a diverging run on the held-out loss, and evaluates on the clients' training and
test data only with ``--eval-client-data`` (those numbers are then listed as not covered). A
non-private run publishes everything and claims nothing. :meth:`Publication.notes` is the
part of the report's privacy section every trainer shares: the guarantee's status, where the
randomness comes from (a seed the report records: a simulation; or the OS CSPRNG with
``--secure-noise``), what is public, what the evaluation uses and what is not covered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from privkit.errors import InvalidParameterError

__all__ = ["Publication", "CLIENT_METRICS", "HELDOUT_METRICS", "TIMING_NOTE", "SEEDED_NOTE",
           "SECURE_NOTE", "guarantee", "check_heldout"]

#: History metrics computed on the clients' own data.
CLIENT_METRICS = ("train_loss", "train_accuracy", "test_accuracy")
#: History metrics computed on the public held-out set.
HELDOUT_METRICS = ("heldout_loss", "heldout_accuracy")

TIMING_NOTE = ("wall-clock timings: how long a round takes depends on which clients took part "
               "and on their record counts; a side channel the guarantee does not analyse")
SEEDED_NOTE = ("seeded simulation: the client sampling, minibatch sampling and noise all come "
               "from the seed this report records, so anyone who reads it can regenerate the "
               "noise; the guarantee holds only against someone who does not know the seed "
               "(--secure-noise draws them from the OS CSPRNG)")
SECURE_NOTE = ("client sampling, minibatch sampling and noise from the OS CSPRNG "
               "(--secure-noise): no seed reproduces them, and a release replayed after a "
               "crash draws fresh noise and is charged again")


def guarantee(proven_maths: bool, secure: bool) -> str:
    """``proven`` (the maths enforced and the randomness secret), ``simulation`` (the maths
    enforced, the randomness seeded) or ``not proven``."""
    if not proven_maths:
        return "not proven"
    return "proven" if secure else "simulation"


def check_heldout(private: bool, has_heldout: bool, client_metrics: bool, dataset: str) -> None:
    """A private run needs something to evaluate on: the public held-out set, or the clients'
    data asked for with ``--eval-client-data``."""
    if private and not has_heldout and not client_metrics:
        raise InvalidParameterError(
            "eval_client_data", False,
            f"given for a private run on {dataset!r}: this data set has no public held-out set "
            "(LEAF's test rows belong to the training users), so the run could only evaluate "
            "on the clients' own data, whose metrics the epsilon does not cover "
            "(--eval-client-data lists them as not covered)")


@dataclass(frozen=True)
class Publication:
    """One run's release policy (module docstring).

    Attributes:
        private: whether the run claims a privacy guarantee.
        client_metrics: also evaluate on the clients' training and test data
            (``--eval-client-data``; not covered).
        secure: noise and sampling from the OS CSPRNG (``--secure-noise``).
        seed: the run's seed (recorded; for a seeded private run, the noise's).
        heldout: where the held-out set comes from (the data set's ``heldout`` note), None
            when it has none.
    """

    private: bool
    client_metrics: bool = False
    secure: bool = False
    seed: int = 0
    heldout: str | None = None

    @property
    def evaluate_clients(self) -> bool:
        """Whether rows hold metrics on the clients' own data."""
        return not self.private or self.client_metrics

    @property
    def loss_key(self) -> str:
        """The loss the divergence stop and the progress bar watch: a private run's is the
        held-out loss (a decision on public data), a non-private run's the training loss."""
        return "heldout_loss" if self.private else "train_loss"

    @property
    def accuracy_key(self) -> str:
        return "heldout_accuracy" if self.private else "test_accuracy"

    def randomness(self) -> dict[str, Any]:
        """The report's ``randomness`` entry."""
        if self.secure:
            return {"source": "os_csprng", "seed": self.seed, "note": SECURE_NOTE,
                    "seeded_streams": "data, initialisation, local batch order and stragglers "
                                      "(not part of the guarantee's randomness)"}
        return {"source": "seed", "seed": self.seed, "note": SEEDED_NOTE}

    def not_covered(self, dataset_description: Mapping[str, Any] | None = None,
                    extra: Iterable[tuple[str, str]] = ()) -> list[dict[str, str]]:
        """``[{"field", "reason"}]`` of what this private run writes outside its epsilon."""
        items = [("wall_time_s, client_compute_s", TIMING_NOTE)]
        if self.client_metrics:
            items.append((", ".join(CLIENT_METRICS), "computed on the clients' own training "
                          "and test data (--eval-client-data)"))
        pre = (dataset_description or {}).get("data_dependent_preprocessing")
        if pre:
            items.append(("the data set's preprocessing", pre))
        items.extend(extra)
        return [{"field": f, "reason": r} for f, r in items]

    def notes(self, *, proven_maths: bool, public: Iterable[str],
              dataset_description: Mapping[str, Any] | None = None,
              extra_not_covered: Iterable[tuple[str, str]] = (),
              not_proven_because: str | None = None) -> dict[str, Any]:
        """The shared part of a private run's ``privacy`` section."""
        g = guarantee(proven_maths, self.secure)
        out: dict[str, Any] = {
            "guarantee": g, "proven": g == "proven", "randomness": self.randomness(),
            "public": list(public),
            "evaluation": ("held-out set: " + self.heldout) if self.heldout else
                          "no public held-out set",
            "not_covered": self.not_covered(dataset_description, extra_not_covered)}
        if g == "simulation":
            out["not_proven_because"] = SEEDED_NOTE
        elif not_proven_because:
            out["not_proven_because"] = not_proven_because
        return out

    def label(self, privacy: Mapping[str, Any]) -> str:
        """The console's mark after an epsilon: empty when proven."""
        g = privacy.get("guarantee", "proven" if privacy.get("proven") else "not proven")
        return {"proven": "", "simulation": "  [seeded simulation: holds only against someone "
                "who does not know the seed]", "not proven": "  [NOT PROVEN]"}[g]
