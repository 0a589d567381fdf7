"""Run metrics: JSONL records, a progress bar, and the eval-loss-vs-bytes plot.

Record kinds (the ``event`` field):
``step``  per-step loss, lr, tokens, tokens/s, cumulative compute/sync seconds and bytes;
``sync``  one fragment sync: fragment, round, bytes sent/received, wait seconds, valid workers;
``eval``  held-out loss of the global model with the cumulative bytes on the wire;
``membership``/``recovery``/``audit``  group events; ``final`` the summary of the run.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence


class MetricsLog:
    """Appends one JSON object per line; safe to share between threads."""

    def __init__(self, path: Path | None, *, worker: str = "") -> None:
        self.path = path
        self.worker = worker
        self._lock = threading.Lock()
        self._file = None
        self._t0 = time.time()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {
            "event": event,
            "worker": self.worker,
            "time": round(time.time() - self._t0, 4),
            **fields,
        }
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps(rec) + "\n")
        return rec

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """A tqdm bar when tqdm is installed and enabled; otherwise nothing."""

    def __init__(self, total: int, *, enabled: bool, desc: str = "train", initial: int = 0) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # optional dependency ([train] extra)
                return
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def update(self, step: int, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.n = step
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], out: Path, *, title: str = ""
) -> Path:
    """Eval loss against bytes sent per worker (log scale) and against inner steps, one line
    per run (e.g. ``{"DDP": records, "Streaming DiLoCo": records}``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, records in runs.items():
        evals = [r for r in records if r.get("event") == "eval"]
        if not evals:
            continue
        ax_b.plot(
            [max(r["bytes_sent"], 1) for r in evals],
            [r["loss"] for r in evals],
            marker="o",
            ms=3,
            label=label,
        )
        ax_s.plot(
            [r["step"] for r in evals], [r["loss"] for r in evals], marker="o", ms=3, label=label
        )
    ax_b.set_xscale("log")
    ax_b.set_xlabel("bytes sent per worker")
    ax_s.set_xlabel("inner step")
    for ax in (ax_b, ax_s):
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
