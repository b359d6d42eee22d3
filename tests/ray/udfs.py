"""Predictors for the Ray tests, in a module the cluster's workers import (tests/ray/conftest.py puts the checkout
on their PYTHONPATH): one that reports the optimizer runs of its process, one that kills its process once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np

from carrack.passes import optimizer
from carrack.ray import CarrackPredictor


class OptimizerRunsPredictor(CarrackPredictor):
    """Adds the optimizer runs of the worker process (0 when the plan arrived compiled) and its pid."""

    def __call__(self, batch):
        out = super().__call__(batch)
        out["optimizer_runs"] = np.full(len(out["id"]), optimizer.RUNS[0], dtype=np.int64)
        out["pid"] = np.full(len(out["id"]), os.getpid(), dtype=np.int64)
        out["threads"] = np.full(len(out["id"]), self.threads, dtype=np.int64)
        return out


class KillOncePredictor(CarrackPredictor):
    """SIGKILLs its own process on the batch holding row `kill_id`, the first time only (a marker file records it),
    after scoring the batch: the batch's result is lost with the process and Ray must run it again."""

    def __init__(self, model, kill_id: int, marker: str, **kwargs):
        super().__init__(model, **kwargs)
        self.kill_id, self.marker = kill_id, Path(marker)

    def __call__(self, batch):
        out = super().__call__(batch)
        if self.kill_id in out["id"] and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return out
