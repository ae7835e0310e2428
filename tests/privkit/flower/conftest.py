"""Fixtures shared by the Flower tests (each test module skips itself without Flower)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower's messages read the run id of the current task; outside a run there is none."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
