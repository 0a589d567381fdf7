"""A two-device tensor-parallel edge cluster behind the OpenAI-compatible HTTP API, and a client.

    python examples/edge_http/main.py        # trains a small model first (~30 s in all)
    python examples/edge_http/main.py --model run/model     # any Llama/Qwen2 HF checkpoint dir
    python examples/edge_http/main.py --tiny                # the smoke test's size

The server is the real command, started as a child process:
``lowband edge run MODEL --devices 2 --port 0`` (a master with the HTTP API and one worker
process; each holds half of every layer). The client below is plain ``urllib``: one ordinary
``/v1/chat/completions`` request and one with ``"stream": true`` (server-sent events), both
greedy, so the two answers must be the same text. The README shows the same with the ``openai``
package.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

LOWBAND = [sys.executable, "-m", "cli"]


def train_model(out: Path, tiny: bool) -> Path:
    """A byte-level Llama trained for a few seconds with `lowband train` (DiLoCo, 2 workers)."""
    steps = "60" if tiny else "400"
    subprocess.run(
        [
            *LOWBAND,
            "train",
            "--preset",
            "tiny",
            "--loopback",
            "--steps",
            steps,
            "--eval-every",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out / "model"


def start_server(model: Path) -> tuple[subprocess.Popen, str]:
    """``lowband edge run`` in its own process group; returns it and its base URL."""
    proc = subprocess.Popen(
        [
            *LOWBAND,
            "edge",
            "run",
            str(model),
            "--devices",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--name",
            "tiny-shakespeare",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode}")
            continue
        if m := re.search(r"serving .* on (http://\S+)", line):
            return proc, m.group(1)
    stop_server(proc)
    raise SystemExit("the server did not start in time")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM unwinds the master, which tells its worker to leave; SIGKILL if it hangs."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )


def chat(base: str, messages: list[dict], max_tokens: int) -> dict:
    """An ordinary request: one JSON answer."""
    req = post(
        f"{base}/v1/chat/completions",
        {
            "model": "tiny-shakespeare",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def chat_stream(base: str, messages: list[dict], max_tokens: int) -> str:
    """``"stream": true``: ``data: {chunk}`` lines until ``data: [DONE]``; print as they come."""
    req = post(
        f"{base}/v1/chat/completions",
        {
            "model": "tiny-shakespeare",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        },
    )
    parts = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise SystemExit(f"the stream failed: {chunk['error']['message']}")
            piece = chunk["choices"][0]["delta"].get("content") or ""
            parts.append(piece)
            print(piece, end="", flush=True)
    print()
    return "".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: train one)")
    ap.add_argument("--out", type=Path, default=Path("edge-http-run"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    model = args.model or train_model(args.out, args.tiny)

    server, base = start_server(model)
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=30) as resp:
            health = json.load(resp)
        print(f"server {base}: {health}")
        messages = [{"role": "user", "content": "Speak, good my lord."}]
        answer = chat(base, messages, args.max_tokens)
        text = answer["choices"][0]["message"]["content"]
        print(f"--- /v1/chat/completions ({answer['usage']}) ---\n{text}")
        print("--- the same request with stream=true ---")
        streamed = chat_stream(base, messages, args.max_tokens)
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
    finally:
        stop_server(server)
    print(f"streamed == non-streamed: {streamed == text}")
    print(
        json.dumps(
            {
                "health": health,
                "text": text,
                "streamed": streamed,
                "usage": answer["usage"],
                "finish_reason": answer["choices"][0]["finish_reason"],
                "metrics_bytes": len(metrics),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
