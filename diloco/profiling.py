"""A Kineto trace of a few inner steps and the outer-step work between them.

``ComputeConfig.profile`` (``lowband train --profile DIR``) turns it on. The inner loop calls
:meth:`StepProfiler.tick` before each step: after ``wait`` steps it starts
``torch.profiler.profile`` (CPU, plus CUDA kernels on a GPU) and after ``steps`` more it stops
and writes ``DIR/trace-slot{slot}-step{first}.json``. Whatever runs between those steps on any
thread is recorded, so a window of at least H/P steps holds a fragment sync: the SEND
(``lowband.encode``), the APPLY (``lowband.outer_step``, ``lowband.merge``) and the staging
copies, beside the ``lowband.inner_step`` ranges. The range names are constants here so that
tests and readers of a trace use the same strings.

Kineto is one profiler per process: when workers run as threads of one process, the first
inner loop to start records (every thread's work lands in its trace) and the others skip.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from diloco.config import ProfileConfig

logger = logging.getLogger(__name__)

INNER_STEP = "lowband.inner_step"
ENCODE = "lowband.encode"  # Δ, its finiteness flag, error feedback (the SEND's device work)
OUTER_STEP = "lowband.outer_step"  # θ_g ← OuterOpt(θ_g, Δ̄)
MERGE = "lowband.merge"  # θ_m ← α·θ_m + (1 − α)·θ_g

_ONE_PER_PROCESS = threading.Lock()


class StepProfiler:
    """Counts the inner steps it is told about; records steps ``wait`` .. ``wait + steps − 1``."""

    def __init__(self, cfg: ProfileConfig | None, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.ticks = 0
        self.path: Path | None = None  # the trace written, once it is
        self._prof: profile | None = None
        self._name = ""

    def tick(self, slot: int, step: int) -> None:
        """Before an inner step: start or stop recording at the configured step counts."""
        cfg = self.cfg
        if cfg is None:
            return
        if self.ticks == cfg.wait and self._prof is None and self.path is None:
            self._start(slot, step)
        elif self.ticks == cfg.wait + cfg.steps:
            self.finish()
        self.ticks += 1

    def _start(self, slot: int, step: int) -> None:
        if not _ONE_PER_PROCESS.acquire(blocking=False):
            logger.info("another worker of this process is being profiled; slot %d is not", slot)
            self.cfg = None
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._name = f"trace-slot{slot}-step{step}.json"
        self._prof = profile(activities=activities, record_shapes=False)
        self._prof.start()

    def finish(self) -> None:
        """Stop and write the trace (also at the end of a run shorter than the window)."""
        prof, self._prof = self._prof, None
        if prof is None or self.cfg is None:
            return
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the kernels of the window, complete
            prof.stop()
            directory = Path(self.cfg.dir)
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / self._name
            prof.export_chrome_trace(str(self.path))
            logger.info("profile of %d steps written to %s", self.cfg.steps, self.path)
        finally:
            _ONE_PER_PROCESS.release()
