"""The suite builds what it caches itself, in its own run's directory (tests/conftest.py): converted models, compiled
kernels, Ray's session files. So it passes on a fresh machine exactly as on one where earlier runs left caches warm,
and it never reads what another run (or the user's own work) left in ~/.cache."""

import os
from pathlib import Path

import torch.utils.cpp_extension
from cache_helpers import SUITE_CACHES, TEST_CACHES_ENV

from hybridflow.models import cache_root, resolve_model_path


def suite_directory(tmp_path_factory) -> Path:
    """This run's directory of caches: the one the caller gave (.ci/run: one for both tiers), or beside the test
    processes' own temporary directories (pytest-xdist), or in the one process's."""
    if given := os.environ.get(TEST_CACHES_ENV):
        return Path(given)
    base = tmp_path_factory.getbasetemp()
    return base.parent / "suite" if os.environ.get("PYTEST_XDIST_WORKER") else base / "suite"


def test_every_cache_is_this_run_s_own(tmp_path_factory):
    suite = suite_directory(tmp_path_factory)
    for variable, name in SUITE_CACHES.items():
        assert os.environ[variable] == str(suite / name), variable
    assert os.environ["RAY_TMPDIR"] == str(suite)
    assert cache_root() == suite / "hybridflow"
    assert resolve_model_path("tiny-llama").is_relative_to(suite / "hybridflow")  # built here on first use
    # torch's extension builder (the native engine's decode kernel) and what follows XDG_CACHE_HOME
    assert Path(torch.utils.cpp_extension.get_default_build_root()).is_relative_to(suite / "cache")
    assert not cache_root().is_relative_to(Path.home())
