"""Clients that get things wrong, on purpose: each is answered with the right status or error category and a
message naming the problem, and a bystander session trains on through all of it exactly as it would alone."""

import socket
import time

import httpx
import numpy as np
import pytest
import tinker
from service_helpers import KEY, MODEL, OTHER_KEY
from test_conformance import adam, batch, datum, forward, with_inputs
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


PROTOBUF = {"Content-Type": "application/x-protobuf"}
PROTOBUF_ACCEPT = {"Accept": "application/x-protobuf"}


def post(service, path: str, body=None, *, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    headers.update(kwargs.pop("headers", {}))
    if body is not None:
        kwargs["json"] = body
    return httpx.post(f"{service.url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def result(service, request_id: str, key: str = KEY) -> dict:
    """A future's JSON outcome (its error and category, or its result), polled until ready."""
    while True:
        response = post(service, "retrieve_future", {"request_id": request_id}, key=key, headers=PROTOBUF_ACCEPT)
        if response.headers["content-type"].startswith("application/x-protobuf"):
            return {"protobuf": response.content}
        if response.json().get("type") != "try_again":
            return response.json()


def raw_model(service) -> tuple[str, str]:
    """(session id, model id) made over plain HTTP."""
    session = post(service, "create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    future = post(
        service,
        "create_model",
        {"session_id": session, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2}},
    )
    assert future.status_code == 200, future.text
    return session, result(service, future.json()["request_id"])["model_id"]


def forward_backward_body(model_id: str, seq_id: int, datums: int, loss: str = "cross_entropy") -> bytes:
    request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss)
    for _ in range(datums):
        d = request.data.add()
        d.model_input.add().encoded_text.tokens = np.array([5, 6, 7], dtype=np.int32).tobytes()
        d.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(dense=np.array([6, 7, 8], dtype=np.int64).tobytes(), dtype=pb.DTYPE_INT64, shape=[3])
        )
        d.loss_fn_inputs["weights"].CopyFrom(
            pb.Tensor(dense=np.ones(3, np.float32).tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[3])
        )
    return request.SerializeToString()


@pytest.fixture
def bystander(clients):
    """A session training on through the test; at the end it must equal the same steps run alone."""
    sc = clients()
    model = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=21).result()
    model.forward_backward(batch(seed=50), "cross_entropy").result()
    model.optim_step(adam()).result()
    yield model
    model.forward_backward(batch(seed=51), "cross_entropy").result()
    model.optim_step(adam()).result()
    alone = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=21).result()
    for seed in (50, 51):
        alone.forward_backward(batch(seed=seed), "cross_entropy").result()
        alone.optim_step(adam()).result()
    held_out = batch(seed=52, count=3)
    for got, want in zip(forward(model, held_out), forward(alone, held_out)):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_keys_and_ownership(service, clients, bystander):
    assert post(service, "create_session", {"tags": []}, key=None).status_code == 401  # no key
    refused = post(service, "create_session", {"tags": []}, key="tml-not-a-key-of-this-service")
    assert refused.status_code == 401 and "API key" in refused.json()["error"]
    assert httpx.get(f"{service.url}/api/v1/get_server_capabilities").status_code == 401
    theirs = clients(OTHER_KEY).create_lora_training_client(base_model=MODEL, rank=2).result()
    step = post(service, "optim_step", {"model_id": theirs.model_id, "seq_id": 1, "adam_params": {}})
    assert step.status_code == 404 and "another key's" in step.json()["error"]  # another key's model
    assert post(service, "get_info", {"model_id": theirs.model_id}).status_code == 404
    path = theirs.save_state("private").result().path
    mine = clients()
    with pytest.raises(tinker.NotFoundError, match="another API key"):  # another key's saved path
        mine.create_training_client_from_state(path).result()
    session, _ = raw_model(service)
    assert post(service, "session_heartbeat", {"session_id": session}, key=OTHER_KEY).status_code == 404
    assert post(service, "session_heartbeat", {"session_id": session}).status_code == 200


def test_bad_training_requests_fail_alone_with_the_reason(service, clients, bystander):
    sc = clients()

    def fresh():
        return sc.create_lora_training_client(base_model=MODEL, rank=2).result()

    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary") as error:  # out-of-range ids
        fresh().forward_backward([datum([5, 6, 10**6])], "cross_entropy").result()
    assert error.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match="not served here"):  # an unknown loss
        fresh().forward_backward([datum([5, 6, 7])], "dro").result()
    incomplete = with_inputs([datum([5, 6, 7])], logprobs=[np.zeros(2)])
    with pytest.raises(tinker.RequestFailedError, match=r"needs loss inputs \['advantages'\]"):
        fresh().forward_backward(incomplete, "importance_sampling").result()
    with pytest.raises(tinker.RequestFailedError, match="checkpoint name"):  # a path out of its directory
        fresh().save_state("../../escape").result()
    with pytest.raises(tinker.BadRequestError, match="max_lora_rank"):
        sc.create_lora_training_client(base_model=MODEL, rank=64).result()
    with pytest.raises(tinker.BadRequestError, match="serves 'tiny-llama'"):
        sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result()
    session, model_id = raw_model(service)
    oversized = post(service, "forward_backward", content=forward_backward_body(model_id, 1, 5), headers=PROTOBUF)
    assert "at most 3" in result(service, oversized.json()["request_id"])["error"]  # limits.max_datums_per_request
    reused = post(service, "forward_backward", content=forward_backward_body(model_id, 1, 1), headers=PROTOBUF)
    assert reused.status_code == 400 and "already used" in reused.json()["error"]
    fine = post(service, "forward_backward", content=forward_backward_body(model_id, 2, 2), headers=PROTOBUF)
    assert "error" not in result(service, fine.json()["request_id"])  # the model goes on after its bad request
    for seq in range(5):  # the session's limit of models (4; raw_model's is one)
        answer = post(
            service,
            "create_model",
            {"session_id": session, "model_seq_id": 10 + seq, "base_model": MODEL, "lora_config": {"rank": 2}},
        )
    assert answer.status_code == 400 and "at most 4 models" in answer.json()["error"]


def test_malformed_and_oversized_bodies_are_answered(service, bystander):
    session, model_id = raw_model(service)
    garbage = post(service, "forward_backward", content=b"\xff\x00 not protobuf", headers=PROTOBUF)
    assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["error"]
    as_json = post(service, "forward_backward", {"model_id": model_id})
    assert as_json.status_code == 415
    bad_json = post(service, "create_session", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]
    wrong_type = post(service, "optim_step", {"model_id": model_id, "seq_id": "soon"})
    assert wrong_type.status_code == 400 and "seq_id" in wrong_type.json()["error"]
    assert post(service, "no_such_endpoint", {}).status_code == 404
    too_many = {
        "sampling_session_id": f"{session}:sample:0",
        "num_samples": 9,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
        "sampling_params": {"max_tokens": 4},
    }
    assert (
        post(
            service,
            "create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL},
        ).status_code
        == 200
    )
    assert "at most 8" in post(service, "asample", too_many).json()["error"]  # limits.max_samples_per_request
    too_long = {**too_many, "num_samples": 1, "sampling_params": {"max_tokens": 5000}}
    assert "at most 1024" in post(service, "asample", too_long).json()["error"]
    topk = {**too_many, "num_samples": 1, "topk_prompt_logprobs": 5, "prompt_logprobs": True}
    assert "not served" in post(service, "asample", topk).json()["error"]
    # a body declared larger than limits.max_body_bytes is refused before it is read
    with socket.create_connection(("127.0.0.1", service.port)) as raw:
        raw.sendall(
            b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 999999999\r\n\r\n{"
        )
        assert b" 413 " in raw.recv(4096).split(b"\r\n")[0]


def test_a_client_that_disconnects_mid_request_leaves_the_service_serving(service, bystander):
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", service.port)) as raw:
            raw.sendall(
                b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: "
                + KEY.encode()
                + b"\r\nContent-Type: application/x-protobuf\r\nContent-Length: 5000\r\n\r\n"
                + b"\x0a" * 100
            )
        # closed with 4900 bytes still owed
    time.sleep(0.5)
    assert service.alive()
