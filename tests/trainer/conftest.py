import pytest

from hybridflow.data.tasks import write_task


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("arithmetic")
    write_task("arithmetic", out, train=64, test=8, seed=0)
    return out / "train.parquet", out / "test.parquet"
