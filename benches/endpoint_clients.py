"""What hostile clients cost the HTTP endpoint of ``kvtier serve``: counts, not timings.

Starts ``kvtier serve`` on a throwaway tier with ``--metrics-addr 127.0.0.1:0`` and prints:

* whether a plain ``GET /metrics`` (HTTP/1.1, no ``Connection: close``) is answered and the
  connection closed within 5 s;
* the server's thread count with 200 idle connections open, and again 8 s later;
* whether ``/healthz`` answers meanwhile;
* how much of an endless header line (1 MiB writes, 256 MiB at most) the server takes before it
  answers or cuts the connection, its answer, and the server's resident memory after it;
* the exit code after SIGTERM (30 s at most).

It measured why the endpoint keeps its own server instead of ``tiny_http`` (docs/metrics.md,
"Why the endpoint has its own server"); run it against any build of the endpoint:

    cargo build
    python3 benches/endpoint_clients.py target/debug/kvtier

Loopback only; every loop is bounded; standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(l for l in f if l.startswith("VmRSS"))
    return int(line.split()[1]) // 1024


def get(addr, path: str, close: bool = False) -> tuple[str, bool]:
    """The status line, and whether the server closed the connection within 5 s."""
    with socket.create_connection(addr, timeout=5) as s:
        extra = "Connection: close\r\n" if close else ""
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
        out, closed = b"", True
        try:
            while chunk := s.recv(65536):
                out += chunk
        except socket.timeout:
            closed = False
    return out.split(b"\r\n")[0].decode(errors="replace"), closed


def endless_header(addr) -> tuple[int, str]:
    """MiB the server took of an endless header line, and what it answered."""
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: ")
        sent, ended = 0, "no answer"
        try:
            while sent < 256 << 20:
                s.sendall(b"b" * (1 << 20))
                sent += 1 << 20
        except OSError as e:
            ended = f"cut ({type(e).__name__})"
        s.settimeout(1)
        try:
            answer = s.recv(200).split(b"\r\n")[0].decode(errors="replace")
            ended = answer or ended
        except OSError:
            pass
    return sent >> 20, ended


def main() -> int:
    kvtier = sys.argv[1]
    work = tempfile.mkdtemp(dir="/tmp")
    os.makedirs(f"{work}/tier")
    config = {"cpu_bytes_to_use": "8MiB",
              "secondary_tiers": [{"type": "nvme", "paths": [f"{work}/tier"],
                                   "capacity_bytes": "16MiB"}]}
    with open(f"{work}/kvtier.json", "w") as f:
        json.dump(config, f)
    serve = subprocess.Popen([kvtier, "serve", "--config", f"{work}/kvtier.json",
                              "--metrics-addr", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = serve.stdout.readline().strip()
        host, port = line.split("http://")[1].split("/")[0].rsplit(":", 1)
        addr = (host, int(port))
        pid = serve.pid
        time.sleep(0.5)
        print(f"at start: {threads(pid)} threads, {rss_mib(pid)} MiB resident")
        status, closed = get(addr, "/metrics")
        print(f"GET /metrics: {status!r}, connection closed after it: {closed}")
        idle = [socket.create_connection(addr) for _ in range(200)]
        time.sleep(1)
        print(f"200 idle connections: {threads(pid)} threads")
        time.sleep(7)
        print(f"8 s later: {threads(pid)} threads")
        status, _ = get(addr, "/healthz", close=True)
        print(f"GET /healthz meanwhile: {status!r}")
        for s in idle:
            s.close()
        time.sleep(1)
        taken, ended = endless_header(addr)
        print(f"endless header line: {taken} MiB taken, then {ended!r}; "
              f"{rss_mib(pid)} MiB resident")
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            print("did not exit within 30 s of SIGTERM")
            serve.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(f"exit code after SIGTERM: {serve.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
