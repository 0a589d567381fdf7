"""Run metrics: JSONL records, a progress bar, and the eval-loss-vs-bytes plot.

Record kinds (the ``event`` field):
``step``  per-step loss, lr, tokens, tokens/s, cumulative compute/sync seconds and bytes;
``sync``  one fragment sync: fragment, round, bytes sent/received, wait seconds, valid workers;
``eval``  held-out loss of the global model with the cumulative bytes on the wire;
``membership``/``recovery``/``audit``  group events; ``final`` the summary of the run.

:class:`RunSummary` reads the ``final`` records of a run's workers and says whether the run ended
in one state; every command that reports a run (``lowband train``, ``lowband demo``, Flower, the
compose demo's ``docker/compare.py``) uses it, so ``consistent`` means the same everywhere.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TextIO


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


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Whether a run's workers ended in one state: ``consistent`` when every expected worker
    reported a final state and all final state hashes are equal.

    A worker without a final state that counts is *missing*, with the reason: no ``final``
    record, a non-zero exit code, or a final record from before the last step. Its state is
    older or unknown, so it must not make the run look healthy (comparing only the hashes that
    exist would). Among the workers that reported, those whose hash is not the most common one
    *differ*.

    A worker that finished in a group without some of the others (its final record's ``group``
    lacks their ``peer_id``) finished *apart*: it was out of the group when they finished (a
    pause or an outage in the last sync period that outlasted their ``final_grace``). The
    reason names it, with how much later it finished (``finished_at``), so a differing hash
    comes with its cause.
    """

    expected: tuple[str, ...]  # the workers that should have finished
    hashes: Mapping[str, int]  # worker -> hash of its final state, for the states that count
    missing: Mapping[str, str]  # worker -> why it has no final state that counts
    apart: Mapping[str, str] = field(default_factory=dict)  # worker -> whom it finished without

    @classmethod
    def from_finals(
        cls,
        expected: Iterable[str],
        finals: Mapping[str, Mapping[str, Any]],
        *,
        steps: int | None = None,
        exit_codes: Mapping[str, int] | None = None,
    ) -> RunSummary:
        """From each worker's ``final`` record (``state_hash``, ``steps``). ``steps``: the step
        every worker must have reached; ``exit_codes``: each worker's process exit status."""
        codes = exit_codes or {}
        hashes: dict[str, int] = {}
        why: dict[str, str] = {}
        for name in sorted(set(expected) | set(finals)):
            final, code = finals.get(name), codes.get(name, 0)
            if final is None:
                why[name] = "no final record" + (f" (exit code {code})" if code else "")
            elif code:
                why[name] = f"exited with code {code}"
            elif steps is not None and final.get("steps") != steps:
                why[name] = f"stopped at step {final.get('steps')} of {steps}"
            elif final.get("state_hash") is None:
                why[name] = "its final record has no state_hash"
            else:
                hashes[name] = final["state_hash"]
        return cls(
            expected=tuple(sorted(expected)),
            hashes=hashes,
            missing=why,
            apart=_apart(sorted(expected), finals),
        )

    @property
    def finished(self) -> tuple[str, ...]:
        """The workers whose final state counts."""
        return tuple(sorted(self.hashes))

    @property
    def differ(self) -> tuple[str, ...]:
        """Workers whose final hash is not the most common one (ties: the first worker's)."""
        if len(set(self.hashes.values())) <= 1:
            return ()
        counts = Counter(self.hashes.values())
        top = max(counts.values())
        common = next(h for _, h in sorted(self.hashes.items()) if counts[h] == top)
        return tuple(sorted(w for w, h in self.hashes.items() if h != common))

    @property
    def consistent(self) -> bool:
        return not self.missing and len(set(self.hashes.values())) == 1

    @property
    def reason(self) -> str | None:
        """Why the run is not consistent, for a user to read; None when it is."""
        if self.consistent:
            return None
        parts = [f"{w} missing ({why})" for w, why in sorted(self.missing.items())]
        if self.differ:
            parts.append(
                "final state differs: "
                + ", ".join(f"{w} ({self.apart[w]})" if w in self.apart else w for w in self.differ)
            )
        return "; ".join(parts) or "no worker reported a final state"

    def to_dict(self) -> dict[str, Any]:
        """The JSON keys every run report carries."""
        return {
            "consistent": self.consistent,
            "missing": dict(sorted(self.missing.items())),
            "differ": list(self.differ),
            "inconsistency": self.reason,
        }


def _apart(expected: Sequence[str], finals: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Worker -> whom it finished without and how much later, for the workers whose final
    record's ``group`` lacks another expected worker's ``peer_id``."""
    ids = {name: f.get("peer_id") for name, f in finals.items()}
    out: dict[str, str] = {}
    for name, final in finals.items():
        group = final.get("group")
        if not group:  # a record from before groups were reported, or the DDP baseline
            continue
        without = [w for w in expected if w != name and ids.get(w) not in (None, *group)]
        if not without:
            continue
        text = "finished in a group without " + ", ".join(without)
        mine = final.get("finished_at")
        theirs = [finals[w].get("finished_at") for w in without]
        if mine is not None and all(t is not None for t in theirs):
            late = mine - max(t for t in theirs if t is not None)
            if late > 0:
                text += (
                    f", {late:.0f}s after they finished: it was out of the group when they "
                    "finished and not back within their final_grace"
                )
        out[name] = text
    return out


class Progress:
    """Training progress on stderr: a tqdm bar on a terminal; in a log (a file, a pipe) one
    plain line each ``log_every`` of the run instead of a redraw per step (a 3200-step run
    would write 3200 bar redraws into its log); nothing when disabled."""

    def __init__(
        self,
        total: int,
        *,
        enabled: bool,
        desc: str = "train",
        initial: int = 0,
        stream: TextIO | None = None,
        log_every: float = 0.1,
    ) -> None:
        self._bar = None
        self._stream: TextIO | None = None
        self._total, self._desc = total, desc
        self._every = max(1, int(total * log_every))
        self._next = (initial // self._every + 1) * self._every
        if not enabled:
            return
        stream = sys.stderr if stream is None else stream
        if not stream.isatty():
            self._stream = stream
            return
        try:
            from tqdm import tqdm
        except ImportError:  # optional dependency ([train] extra)
            return
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=stream,
            dynamic_ncols=True,
        )

    def update(self, step: int, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.n = step
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.refresh()
        elif self._stream is not None and (step >= self._next or step == self._total):
            self._next = (step // self._every + 1) * self._every
            extra = "".join(f" {k}={v}" for k, v in postfix.items())
            pct = 100 * step // max(self._total, 1)
            print(f"{self._desc}: step {step}/{self._total} ({pct}%){extra}", file=self._stream)
            self._stream.flush()

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
