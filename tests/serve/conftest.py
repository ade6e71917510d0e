import pytest
from service_helpers import KEY, client, running_service

# small bounds, so that the SDK chunks a forward_backward (out of order, by datums and by tokens) and polls across
# short waits
SMALL = (
    "limits.max_datums_per_request=3",
    "limits.max_tokens_per_request=1500",
    "limits.max_tokens_per_datum=1024",
    "service.poll_timeout_s=0.5",
    "limits.max_samples_per_request=8",
    "limits.max_models=16",
)


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """One service for the test process's serve modules (tests/conftest.py hands their files to one test process):
    each test's sessions end with it (clients), and each trains models of its own ids."""
    root = tmp_path_factory.mktemp("serve")
    with running_service(root / "storage", root / "service.log", *SMALL) as running:
        yield running


@pytest.fixture
def clients(service):
    """client(key=KEY): a tinker ServiceClient of the service; each one's session ends with the test."""
    made = []

    def make(key: str = KEY):
        made.append(client(service, key))
        return made[-1]

    yield make
    for sdk_client in made:
        sdk_client.close("success").result(timeout=30)
