"""How long /health waits beside one huge request, for `branchspec serve`.

Starts `branchspec serve` in its own process (so this process's probes share no GIL with
it), then, for each of /tokenize, /v1/completions and /v1/chat/completions, sends one
prompt of `--megabytes` of text and, until it is answered, GETs /health again and again.
Reports the huge request's status and time and /health's worst latency beside it. It
asserts nothing. Prints a table, then one line of JSON.

    python scripts/health_under_load.py [--megabytes 7] [--model PATH] [--max-model-len 1024]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

TEXT = "The quick brown fox jumps over the lazy dog, naïve café 12345. "


def request(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def start_server(args) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "branchspec", "serve", "--port", "0", "--max-running-requests", "4",
            "--max-model-len", str(args.max_model_len), "--num-threads", "1", "--log-level", "warning"]
    if args.model:
        argv += ["--model", args.model]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line and proc.poll() is not None:
            break
        if m := re.search(r"ready on (http://\S+)", line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()   # keep it drained
            return proc, m.group(1)
    proc.kill()
    sys.exit("the server did not start")


def beside(url: str, path: str, body: bytes) -> dict:
    answer: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        answer["status"], reply = request(url, "POST", path, body)
        answer["seconds"] = time.monotonic() - t0
        answer["reply"] = reply[:100].decode(errors="replace")

    sender = threading.Thread(target=send)
    sender.start()
    worst, probes = 0.0, 0
    while sender.is_alive():
        t0 = time.monotonic()
        request(url, "GET", "/health")
        worst, probes = max(worst, time.monotonic() - t0), probes + 1
        time.sleep(0.005)
    sender.join()
    return {"path": path, "megabytes": round(len(body) / 1e6, 1), "status": answer["status"],
            "seconds": round(answer["seconds"], 2), "health_worst_ms": round(worst * 1e3), "probes": probes,
            "reply": answer["reply"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=7.0, help="characters of the huge prompt, in millions")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    text = (TEXT * (int(args.megabytes * 1e6) // len(TEXT) + 1))[:int(args.megabytes * 1e6)]
    bodies = {"/tokenize": {"prompt": text},
              "/v1/completions": {"prompt": text, "max_tokens": 4},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": text}], "max_tokens": 4}}
    proc, url = start_server(args)
    try:
        rows = [beside(url, path, json.dumps(body).encode()) for path, body in bodies.items()]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(f"{'route':24} {'MB':>5} {'status':>6} {'seconds':>8} {'/health worst ms':>17} {'probes':>7}")
    for r in rows:
        print(f"{r['path']:24} {r['megabytes']:5} {r['status']:6} {r['seconds']:8} {r['health_worst_ms']:17} "
              f"{r['probes']:7}")
    print(json.dumps({"rows": [{k: v for k, v in r.items() if k != "reply"} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
