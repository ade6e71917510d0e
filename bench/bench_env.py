"""What the benchmarks that compare with TRL share: waiting for the shared machine to be idle, TRL's own virtual
environment (bench/.trl-venv: torch 2.13.0 first, then TRL with torch held; created once), and the comparison of
the fastest settings."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_VENV = REPO / "bench" / ".trl-venv"
TRL_REQUIREMENTS = ["trl==1.16.0", "torch==2.13.0"]  # trl 1.16.0 is the newest; it accepts transformers 5.23


def wait_for_idle(max_load: float, wait_s: float) -> float:
    """Block until the 1-minute load average is below max_load (or wait_s passed); return the load then."""
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load >= max_load and time.monotonic() < deadline:
        print(f"  load {load:.2f} >= {max_load}: waiting for the machine to be idle ...", flush=True)
        time.sleep(20)
        load = os.getloadavg()[0]
    if load >= max_load:
        print(f"  load is still {load:.2f}: measuring anyway (these numbers are pessimistic)", flush=True)
    return load


def ensure_trl_venv() -> Path:
    """bench/.trl-venv with TRL and torch 2.13.0, created once; later runs only check that `import trl` works."""
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    print(f"creating {TRL_VENV} (once) ...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the local CPU wheel, found through the machine's pip config
    subprocess.run([*pip, *TRL_REQUIREMENTS], check=True)
    return python


def tokens_per_second(tokens: list[float], seconds: list[float]) -> float:
    """Tokens over seconds of a run's steps, the first (warm-up) left out."""
    return sum(tokens[1:]) / sum(seconds[1:])


def fastest_ratio(results: list[dict]) -> str:
    """The line comparing the fastest setting of hybridflow with TRL's (``tokens_per_second`` of each result), or
    "" when one of them has no result."""
    best = {
        system: max((r for r in results if r["system"] == system), key=lambda r: r["tokens_per_second"], default=None)
        for system in ("hybridflow", "TRL")
    }
    if not (best["hybridflow"] and best["TRL"]):
        return ""
    ratio = best["hybridflow"]["tokens_per_second"] / best["TRL"]["tokens_per_second"]
    return f"\n\nhybridflow / TRL, the fastest setting of each: {ratio:.2f}x tokens per second"
