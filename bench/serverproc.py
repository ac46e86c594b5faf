"""Start a server command for the length of one benchmark command, wait until it is ready, stop it afterwards.

`--server-cmd "voicelane serve --model random:1.7b --bench-frames-per-word 5 --port 8000"` on the benchmark CLIs
makes one shell command per load point possible (start-up, warm-up, window, shut-down).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request


def http_get_json(url: str, timeout: float = 5.0):
    """(status, parsed JSON or text) of a GET; (None, reason) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read().decode("utf-8", "replace")
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = e.read().decode("utf-8", "replace"), e.code
    except (urllib.error.URLError, OSError) as e:
        return None, str(e)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def wait_ready(base_url: str, timeout: float, proc: subprocess.Popen | None = None, path: str = "/ready"):
    """Poll GET {base_url}/ready until it answers 200; returns its JSON. Raises if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        status, body = http_get_json(base_url.rstrip("/") + path, timeout=5)
        if status == 200:
            return body
        last = (status, body)
        time.sleep(0.5)
    raise TimeoutError(f"server at {base_url} not ready after {timeout:.0f}s (last answer: {last})")


class ServerProcess:
    """Context manager around a server command line (started in its own process group)."""

    def __init__(self, cmd: str, base_url: str, ready_timeout: float = 300.0, log_path: str | None = None):
        self.cmd, self.base_url, self.ready_timeout, self.log_path = cmd, base_url, ready_timeout, log_path
        self.proc: subprocess.Popen | None = None
        self.ready: dict | None = None
        self.startup_s: float | None = None
        self._log = None

    def __enter__(self):
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        t0 = time.monotonic()
        self.proc = subprocess.Popen(shlex.split(self.cmd), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=os.environ.copy())
        try:
            self.ready = wait_ready(self.base_url, self.ready_timeout, self.proc)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def stop(self, grace: float = 20.0) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None
