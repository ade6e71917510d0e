"""The suite's own caches (tests/conftest.py makes them), and looking into a model cache from a test."""

from pathlib import Path

# Where a process keeps what it builds once and reuses: converted models, compiled kernels (and Ray's session files,
# under RAY_TMPDIR). The suite points each at a directory of its own run.
SUITE_CACHES = {
    "HYBRIDFLOW_CACHE": "hybridflow",  # built-in models (tiny-*, the converted SmolLM2), the planner's calibration
    "XDG_CACHE_HOME": "cache",  # torch's compiled extensions (the ragged decode kernel), vLLM, matplotlib
    "TORCHINDUCTOR_CACHE_DIR": "inductor",  # torch.compile's kernels (vLLM's CPU backend)
    "TRITON_CACHE_DIR": "triton",
}
# A directory for the suite's caches that outlives one pytest command (.ci/run gives both tiers one, made empty, so
# that the slow tier reuses the models and kernels the fast tier built); without it each command builds its own.
TEST_CACHES_ENV = "HYBRIDFLOW_TEST_CACHES"


def built_models(cache: Path) -> list[str]:
    """The models built into ``cache``, or being built (a build's temporary directory and lock count)."""
    models = cache / "models"
    return sorted(entry.name for entry in models.iterdir()) if models.is_dir() else []
