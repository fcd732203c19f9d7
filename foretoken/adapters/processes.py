"""Starting and stopping foretoken's own processes (demo, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

POLL_S = 0.2
STOP_GRACE_S = 15.0


def foretoken_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "foretoken.cli", *args]


def spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    return subprocess.Popen(
        args,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def get_json(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> Any:
    """Poll a JSON URL until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            return get_json(url)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = exc
        time.sleep(POLL_S)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s ({last})")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    """Stop a process group started by ``spawn``: signal, wait, then kill."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (another process has it, or the address is
    not this machine's), or None: a service checks before it starts, so that the mistake is
    one line, not a library's traceback from deep in its start-up."""
    import socket

    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None
