"""Every test module of tests/models gets its own empty model cache (`$HYBRIDFLOW_CACHE`)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybridflow_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRIDFLOW_CACHE", str(root))
        yield root
