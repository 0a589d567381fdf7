"""Liveness soak: ``python -m benchmarks.chaos --minutes N --json`` (last line JSON).

Runs, side by side on this machine, a 2-worker training job (``lowband coordinator`` + two
``lowband worker`` processes, tiny preset, in rounds) and a 2-device edge cluster (``lowband edge
serve --workers 1`` + one ``lowband edge worker``), keeps waves of concurrent greedy streams
going against the cluster with oversize and malformed requests among them, and injects faults
at seeded random intervals, one at a time:

* ``stop_train_worker`` / ``stop_edge_worker`` / ``stop_edge_master``: SIGSTOP longer than the
  deadline (``--dead-after``), then SIGCONT;
* ``kill_train_worker`` / ``kill_edge_worker``: kill -9, restarted by the soak (a supervisor);
* ``kill_coordinator``: kill -9 of the training coordinator, restarted at the same address;
* ``cpu_hog``: one busy process per core for a few seconds.

After each fault the soak waits (up to ``--recovery-bound``) until the edge ``/health`` is 200
again and training advanced past where it stood: that wait is the fault's recovery time.
Every completed stream's text must equal the fault-free text taken before the first fault, and
the workers of each finished training round must report equal state hashes.

Counts in the JSON: a request is ``ok`` (200, text equal), ``failed_with_clear_error`` (a 4xx/5xx
JSON error or an in-band SSE error: what a client can act on), ``unclear`` (a dropped
connection or a timeout), ``wrong`` (200 with a different text, or a bad request accepted).
``lost_progress_steps`` sums every drop of the training group's highest logged step (0 when
no fault ever set training back).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lowband.proc import free_port

PY = sys.executable
CFG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
PROMPT = "The quick brown fox"
MAX_TOKENS = 12
FAULTS = (
    "stop_train_worker",
    "stop_edge_worker",
    "stop_edge_master",
    "kill_train_worker",
    "kill_edge_worker",
    "kill_coordinator",
    "cpu_hog",
)


# ---- HTTP client: one greedy stream, and the bad requests --------------------------------
def stream(port: int, timeout: float = 120.0) -> tuple[str, str]:
    """One streamed greedy completion: ("ok", text) | ("error", why) | ("unclear", why)."""
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    ).encode()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            err = json.loads(r.read() or b"{}")
            return ("error", str(r.status)) if "error" in err else ("unclear", str(r.status))
        text = []
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return "error", "in-band"
            text.append(ev["choices"][0]["text"])
        conn.close()
        return "ok", "".join(text)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        return "unclear", type(exc).__name__


def bad_request(port: int, kind: str) -> bool:
    """Send an oversize or malformed request; True when it is refused with a JSON 4xx."""
    bodies = {
        "oversize": b'{"prompt": "' + b"x" * (5 << 20) + b'"}',
        "not_json": b'{"prompt": "unterminated',
        "bad_field": json.dumps({"prompt": PROMPT, "max_tokens": -3}).encode(),
    }
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", bodies[kind], {"Content-Type": "application/json"})
        r = conn.getresponse()
        ok = 400 <= r.status < 500 and "error" in json.loads(r.read() or b"{}")
        conn.close()
        return ok
    except (OSError, http.client.HTTPException, json.JSONDecodeError):
        return False  # the server may close an oversize upload early: not a clear refusal


def health(port: int) -> int:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return status
    except (OSError, http.client.HTTPException):
        return 0


def wave(port: int, streams: int, ref: str, counts: dict, lock: threading.Lock) -> None:
    """``streams`` concurrent greedy streams with one of each bad request among them."""
    kinds = ["stream"] * streams + ["oversize", "not_json", "bad_field"]
    random.Random(len(kinds)).shuffle(kinds)
    with ThreadPoolExecutor(len(kinds)) as pool:
        futs = [
            (
                k,
                pool.submit(
                    stream if k == "stream" else bad_request, port, *(() if k == "stream" else (k,))
                ),
            )
            for k in kinds
        ]
        for kind, f in futs:
            res = f.result()
            with lock:
                if kind != "stream":
                    counts["bad_refused" if res else "wrong"] += 1
                elif res[0] == "ok":
                    counts["ok" if res[1] == ref else "wrong"] += 1
                else:
                    counts["clear" if res[0] == "error" else "unclear"] += 1


# ---- the processes ------------------------------------------------------------------------
class Soak:
    def __init__(self, work: Path, dead_after: float, train_steps: int) -> None:
        self.work, self.dead_after, self.train_steps = work, dead_after, train_steps
        self.procs: dict[str, subprocess.Popen] = {}
        self.coord_port, self.edge_bind, self.http = free_port(), free_port(), free_port()
        self.round, self.rounds_consistent, self.rounds_inconsistent = 0, 0, 0
        self.lost_steps, self._top = 0, 0
        self.live = ["--heartbeat", str(dead_after / 2), "--dead-after", str(dead_after)]
        self.edge_model = ""  # the edge master's checkpoint, served by the edge worker too

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.work / f"{name}.log", "a")
        self.procs[name] = subprocess.Popen(
            [PY, "-m", "cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_coordinator(self) -> None:
        self._spawn(
            "coord", ["coordinator", "--bind", f"tcp://127.0.0.1:{self.coord_port}", *self.live]
        )

    def start_train_worker(self, i: int) -> None:
        self._spawn(
            f"train{i}",
            [
                "worker",
                "--coordinator",
                f"tcp://127.0.0.1:{self.coord_port}",
                "--preset",
                "tiny",
                "--workers",
                "2",
                "--steps",
                str(self.train_steps),
                "--eval-every",
                "0",
                "--id",
                str(i),
                "--out",
                str(self.run_dir),
                "--bind-host",
                "127.0.0.1",
                "--threads",
                "1",
            ],
        )

    @property
    def run_dir(self) -> Path:
        return self.work / f"train-round{self.round}"

    def start_edge_master(self, ckpt: Path) -> None:
        self.edge_model = str(ckpt)
        self._spawn(
            "edge_master",
            [
                "edge",
                "serve",
                str(ckpt),
                "--workers",
                "1",
                "--layout",  # the tensor-parallel cluster and its recovery
                "tp",
                "--bind",
                f"tcp://127.0.0.1:{self.edge_bind}",
                "--port",
                str(self.http),
                "--max-queue",
                "256",
                *self.live,
            ],
        )

    def start_edge_worker(self) -> None:
        self._spawn(
            "edge_worker",
            [
                "edge",
                "worker",
                "--master",
                f"tcp://127.0.0.1:{self.edge_bind}",
                "--model-dir",
                self.edge_model,
            ],
        )

    def kill(self, name: str) -> None:
        p = self.procs[name]
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(30)

    def stop_all(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    continue
                self.kill(name)

    # ---- training progress and rounds -----------------------------------------------------
    def steps(self) -> int:
        """The training group's highest logged step in this round."""
        top = 0
        for i in range(2):
            path = self.run_dir / f"metrics-worker{i}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines()[-50:]:
                    if '"event": "step"' in line:
                        try:
                            top = max(top, json.loads(line)["step"])
                        except json.JSONDecodeError:
                            pass  # a line being written
        return top

    def tick_training(self) -> None:
        """Account lost progress; when a round ended, check its hashes and start the next."""
        now = self.steps()
        if now < self._top:
            self.lost_steps += self._top - now
        self._top = now
        workers = [self.procs.get(f"train{i}") for i in range(2)]
        if any(w is None or w.poll() is None for w in workers):
            return
        finals = []
        for i in range(2):
            path = self.run_dir / f"metrics-worker{i}.jsonl"
            recs = [json.loads(x) for x in path.read_text().splitlines() if '"final"' in x]
            finals.append(recs[-1] if recs else None)
        good = (
            all(w.returncode == 0 for w in workers)
            and all(finals)
            and finals[0]["state_hash"] == finals[1]["state_hash"]
            and finals[0]["steps"] == finals[1]["steps"] == self.train_steps
        )
        self.rounds_consistent += good
        self.rounds_inconsistent += not good
        self.round += 1
        self._top = 0
        for i in range(2):
            self.start_train_worker(i)


def make_checkpoint(path: Path) -> Path:
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.tokenizer import ByteTokenizer
    from lowband.models.weights import save_pretrained

    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, std=0.2, seed=11)
    save_pretrained(m, path)
    ByteTokenizer().save(path)
    return path


def wait_until(pred, timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def inject(soak: Soak, fault: str, rng: random.Random) -> None:
    """Inject one fault and undo it (SIGCONT, restart, end of the hog)."""
    pause = soak.dead_after + 3.0
    if fault.startswith("stop_"):
        name = {
            "stop_train_worker": f"train{rng.randrange(2)}",
            "stop_edge_worker": "edge_worker",
            "stop_edge_master": "edge_master",
        }[fault]
        pid = soak.procs[name].pid
        try:
            os.killpg(pid, signal.SIGSTOP)
            time.sleep(pause)
            os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # it finished its round meanwhile
    elif fault == "kill_train_worker":
        i = rng.randrange(2)
        if soak.procs[f"train{i}"].poll() is None:
            soak.kill(f"train{i}")
            soak.start_train_worker(i)
    elif fault == "kill_edge_worker":
        soak.kill("edge_worker")
        soak.start_edge_worker()
    elif fault == "kill_coordinator":
        soak.kill("coord")
        time.sleep(1.0)
        soak.start_coordinator()
    elif fault == "cpu_hog":
        hogs = [
            subprocess.Popen([PY, "-c", "while True: pass"], start_new_session=True)
            for _ in range(os.cpu_count() or 1)
        ]
        time.sleep(pause)
        for h in hogs:
            h.kill()
            h.wait()


def run(
    minutes: float,
    seed: int,
    streams: int,
    dead_after: float,
    gap: tuple[float, float],
    train_steps: int,
    recovery_bound: float,
) -> dict:
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="lowband-chaos-"))
    soak = Soak(work, dead_after, train_steps)
    counts = dict(ok=0, clear=0, unclear=0, wrong=0, bad_refused=0)
    lock = threading.Lock()
    recoveries: list[float] = []
    injected: dict[str, int] = {}
    unrecovered: list[str] = []
    stop = threading.Event()
    try:
        soak.start_coordinator()
        for i in range(2):
            soak.start_train_worker(i)
        soak.start_edge_master(make_checkpoint(work / "ckpt"))
        soak.start_edge_worker()
        if not wait_until(lambda: health(soak.http) == 200, 180):
            raise RuntimeError(f"the edge cluster did not come up; see {work}")
        status, ref = stream(soak.http)
        if status != "ok":
            raise RuntimeError(f"no fault-free reference text ({ref}); see {work}")

        def load() -> None:
            while not stop.is_set():
                wave(soak.http, streams, ref, counts, lock)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        t_end = time.monotonic() + 60 * minutes
        while time.monotonic() < t_end:
            end_gap = time.monotonic() + rng.uniform(*gap)
            while time.monotonic() < end_gap:
                soak.tick_training()
                time.sleep(0.25)
            fault = rng.choice(FAULTS)
            injected[fault] = injected.get(fault, 0) + 1
            inject(soak, fault, rng)
            t0, base = time.monotonic(), soak.steps()
            round0 = soak.round

            def healed() -> bool:
                soak.tick_training()
                return health(soak.http) == 200 and (soak.steps() > base or soak.round > round0)

            if wait_until(healed, recovery_bound):
                recoveries.append(time.monotonic() - t0)
            else:
                unrecovered.append(fault)
        stop.set()
        loader.join(300)
    finally:
        stop.set()
        soak.stop_all()
    return {
        "minutes": minutes,
        "seed": seed,
        "streams_per_wave": streams,
        "dead_after_s": dead_after,
        "faults_injected": sum(injected.values()),
        "faults_by_kind": injected,
        "recovered": len(recoveries),
        "not_recovered": unrecovered,
        "max_recovery_s": round(max(recoveries), 2) if recoveries else None,
        "median_recovery_s": round(statistics.median(recoveries), 2) if recoveries else None,
        "requests_ok": counts["ok"],
        "requests_failed_with_clear_error": counts["clear"],
        "requests_failed_unclear": counts["unclear"],
        "requests_wrong": counts["wrong"],
        "bad_requests_refused": counts["bad_refused"],
        "train_rounds_consistent": soak.rounds_consistent,
        "train_rounds_inconsistent": soak.rounds_inconsistent,
        "lost_progress_steps": soak.lost_steps,
        "work_dir": str(work),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streams", type=int, default=64, help="concurrent greedy streams per wave")
    p.add_argument("--dead-after", type=float, default=3.0, help="the deadline, seconds")
    p.add_argument(
        "--gap",
        type=float,
        nargs=2,
        default=(10.0, 25.0),
        help="seconds between faults: uniform in [MIN, MAX]",
    )
    p.add_argument("--train-steps", type=int, default=1500, help="steps of one training round")
    p.add_argument("--recovery-bound", type=float, default=120.0)
    p.add_argument(
        "--tiny",
        action="store_true",
        help="smoke sizes: 0.3 min, 8 streams, faults every 2-4 s, 200-step rounds",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    a = p.parse_args()
    if a.tiny:
        a.minutes, a.streams, a.gap, a.train_steps = min(a.minutes, 0.3), 8, (2.0, 4.0), 200
    res = run(
        a.minutes, a.seed, a.streams, a.dead_after, tuple(a.gap), a.train_steps, a.recovery_bound
    )
    print(json.dumps(res) if a.json else json.dumps(res, indent=1), flush=True)


if __name__ == "__main__":
    main()
