"""A real `pointforge serve` process on the tiny models, started and killed by the tests."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import Job

_LISTENING = re.compile(r"listening on (http://\S+)")


class LiveServer:
    """``python -m pointforge serve`` on a free loopback port with ``data_dir``; :meth:`kill` is ``kill -9``."""

    def __init__(self, data_dir: Path, pcdiff: Path, voxelizer: Path, *extra: str, name: str = "serve"):
        cmd = [sys.executable, "-m", "pointforge", "serve", "--pcdiff", str(pcdiff), "--voxelizer", str(voxelizer)]
        cmd += ["--port", "0", "--data-dir", str(data_dir), "--device", "cpu", "--threads", "1"]
        cmd += ["--ensemble", "2", "--sampler", "ddim", "--steps", "3", *extra]
        self.job = Job(cmd, data_dir.parent / "logs", name)
        self.url = self._wait_for_address(timeout=60)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def _wait_for_address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = _LISTENING.search(self.job.output())
            if found:
                return found.group(1)
            if self.job.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.job.stop()
        pytest.fail(f"pointforge serve did not start; output:\n{self.job.output()[-3000:]}")

    def upload(self, body: bytes, name: str = "skull.nrrd") -> httpx.Response:
        return self.client.post("/api/cases", params={"name": name}, content=body)

    def jobs(self) -> list[dict]:
        return self.client.get("/api/cases").json()

    def wait_until_finished(self, count: int, timeout: float = 120) -> list[dict]:
        """Poll until ``count`` jobs exist and none is queued or running; the jobs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.jobs()
            if len(jobs) >= count and all(j["status"] not in ("queued", "running") for j in jobs):
                return jobs
            time.sleep(0.2)
        pytest.fail(f"jobs did not finish in {timeout} s: {self.jobs()}\n{self.job.output()[-2000:]}")

    def kill(self) -> None:
        self.client.close()
        self.job.stop()
