"""A real ``hybridflow serve`` for the tests: its own process (its own Ray cluster and worker), port, storage and
keys; stopped (Ray with it) when the test module ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

KEY = "tml-hybridflow-test-key-a"
OTHER_KEY = "tml-hybridflow-test-key-b"
MODEL = "tiny-llama"
STARTUP_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, storage: Path, log: Path, overrides: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.storage = storage
        env = {**os.environ, "HYBRIDFLOW_SERVE_API_KEYS": f"{KEY},{OTHER_KEY}", "TINKER_TELEMETRY": "0"}
        command = [
            sys.executable,
            "-m",
            "hybridflow.serve.main",
            f"model.path={MODEL}",
            f"service.port={self.port}",
            f"service.storage_dir={storage}",
            "worker.cpus_per_worker=1",
            "model.max_lora_rank=8",
            *overrides,
        ]
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the service exited ({self.process.returncode}):\n{self.log_path.read_text()[-4000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the service did not start in {STARTUP_S} s:\n{self.log_path.read_text()[-4000:]}")

    def alive(self) -> bool:
        return self.process.poll() is None and httpx.get(f"{self.url}/api/v1/healthz", timeout=5).status_code == 200

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful stop; Ray and the worker go with it
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


@contextlib.contextmanager
def running_service(storage: Path, log: Path, *overrides: str) -> Iterator[Service]:
    service = Service(storage, log, list(overrides))
    try:
        yield service
    finally:
        service.stop()


def client(service: Service, key: str = KEY):
    import tinker

    return tinker.ServiceClient(base_url=service.url, api_key=key)
