"""The token route (POST /inference/v1/generate) over a scripted engine: replies as verifiers' TrainClient
validates them, branches extended token for token (a client's stop id cuts a turn), a divergent context starting a
new branch, the sample token-exact, every bad request answered with its status, and an agent's record of its
trajectories checked against the endpoint's."""

import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from endpoint_helpers import EOS, ScriptedBackend, params, rows
from test_endpoint_protocol import response_of

from hybridflow.batch_keys import AGENT_BRANCHES, AGENT_FAILURE, AGENT_REQUESTS, AGENT_REWARD
from hybridflow.models import load_tokenizer
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout
from hybridflow.trainer.setup.config import default_config

TOKEN_AGENTS = Path(__file__).parent / "token_agents.py"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


def token_rollout(tokenizer, function: str, scripts: dict[int, list[str]], **changes) -> AgentFunctionRollout:
    defaults = default_config().actor_rollout_ref.rollout.agent
    config = dataclasses.replace(defaults, function=f"{TOKEN_AGENTS}:{function}" if function else "", **changes)
    backend = ScriptedBackend(tokenizer, scripts, config.max_branches_per_session)
    return AgentFunctionRollout(backend, tokenizer, config, tool_role="tool", format="hermes")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_token_turns_extend_a_branch_token_for_token(tokenizer, tmp_path):
    prompt = ids(tokenizer, "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    tail = ids(tokenizer, "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    newline = ids(tokenizer, "\n")[-1]
    scripts = {0: [f"It is\n4{EOS}", f"Yes{EOS}"], 1: [f"4{EOS}", f"Yes 4{EOS}", f"Four{EOS}"]}
    rollout = token_rollout(tokenizer, "two_turn_token_agent", scripts)
    outs = [tmp_path / "0.json", tmp_path / "1.json"]
    extra = [
        {"prompt_ids": prompt, "tail_ids": tail, "stop_ids": [newline], "out": str(outs[0])},  # cut at the newline
        {"prompt_ids": prompt, "tail_ids": tail, "stop_ids": [], "out": str(outs[1]), "diverge": True},
    ]
    batch = rollout.generate_sequences(rows(["x", "y"], extra=extra), params(64))
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", ""]
    assert batch.batch[AGENT_REQUESTS].tolist() == [2, 3] and batch.batch[AGENT_BRANCHES].tolist() == [1, 2]

    # row 0: the client's stop id cut the first turn after the newline (the engine had gone on: the second turn
    # computes the whole context on a fresh engine request); the reply is what verifiers' client checks
    first, second = json.loads(outs[0].read_text())
    turn1 = ids(tokenizer, f"It is\n4{EOS}")
    cut = turn1[: turn1.index(newline) + 1]
    choice = first["choices"][0]
    assert choice["token_ids"] == cut and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [
        {"token": f"token_id:{t}", "logprob": pytest.approx(-(k + 1) / 100)} for k, t in enumerate(cut)
    ]
    assert second["choices"][0]["finish_reason"] == "stop" and second["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    engine_calls = [c for c in rollout.engine.calls if c[0] // 4 == 0]
    assert [c[0] for c in engine_calls] == [0, 1] and engine_calls[1][1] == prompt + cut + tail
    turn2 = ids(tokenizer, f"Yes{EOS}")
    tokens, mask, log_probs = response_of(batch, 0)
    assert tokens == cut + tail + turn2
    assert mask == [1] * len(cut) + [0] * len(tail) + [1] * len(turn2)
    assert log_probs == pytest.approx(
        [-(k + 1) / 100 for k in range(len(cut))] + [0.0] * len(tail) + [-(k + 1) / 100 for k in range(len(turn2))]
    )

    # row 1: the second turn continued the same engine request (only the tail computed); the edited context
    # started a second branch, which is the sample: its prompt the whole edited context, its one turn generated
    first, second, third = json.loads(outs[1].read_text())
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + len(ids(tokenizer, f"4{EOS}"))
    engine_calls = [c for c in rollout.engine.calls if c[0] // 4 == 1]
    assert [c[0] for c in engine_calls] == [4, 4, 5] and engine_calls[1][1] == tail
    tokens, mask, _ = response_of(batch, 1)
    assert tokens == ids(tokenizer, f"Four{EOS}") and mask == [1] * len(tokens)
    assert third["choices"][0]["token_ids"] == tokens


def test_bad_token_requests_get_their_status_and_the_run_goes_on(tokenizer, tmp_path):
    out = tmp_path / "statuses.json"
    prompt = ids(tokenizer, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    rollout = token_rollout(tokenizer, "bad_token_requests_agent", {0: [f"fine{EOS}"]}, max_prompt_tokens=256)
    batch = rollout.generate_sequences(rows(["Hi"], extra=[{"prompt_ids": prompt, "out": str(out)}]), params(64))
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == [""]
    recorded = json.loads(out.read_text())
    assert recorded["models"]["id"] == "policy" and recorded["models"]["max_model_len"] == 256 + 64
    assert recorded["statuses"] == {
        "no key": [401, "missing_api_key"],
        "wrong key": [401, "invalid_api_key"],
        "unknown session": [404, "session_not_found"],
        "malformed JSON": [400, "invalid_json"],
        "not an object": [400, "invalid_value"],
        "unknown model": [404, "model_not_found"],
        "no token ids": [400, "invalid_value"],
        "empty token ids": [400, "invalid_value"],
        "token id not an integer": [400, "invalid_token_id"],
        "token id out of the vocabulary": [400, "invalid_token_id"],
        "negative token id": [400, "invalid_token_id"],
        "prompt too long": [400, "context_length_exceeded"],
        "max_tokens over the budget": [400, "max_tokens_exceeded"],
        "max_tokens not positive": [400, "invalid_value"],
        "other temperature": [400, "unsupported_value"],
        "other top_p": [400, "unsupported_value"],
        "top_k": [400, "unsupported_value"],
        "repetition penalty": [400, "unsupported_value"],
        "n > 1": [400, "unsupported_value"],
        "top logprobs": [400, "unsupported_value"],
        "stop strings": [400, "unsupported_value"],
        "unknown sampling parameter": [400, "unknown_parameter"],
        "unknown parameter": [400, "unknown_parameter"],
        "multimodal": [400, "unsupported_value"],
        "stop ids out of the vocabulary": [400, "invalid_token_id"],
        "body too large": [413, "body_too_large"],
        "not JSON content type": [415, "unsupported_media_type"],
        "wrong method": [405, "unknown_url"],
        "good": [200, "stop"],
    }
    # none of the refused requests reached the engine or the record
    assert batch.batch[AGENT_REQUESTS].tolist() == [1]
    assert response_of(batch, 0)[0] == ids(tokenizer, f"fine{EOS}")


def _external_token_agent(endpoint_dir: Path, prompt: list[int], statuses: list) -> None:
    """Claims the call's two sessions; generates one turn each; posts the reward with its record of the
    trajectory: exact for the first session, its mask changed for the second."""
    deadline = time.time() + 60
    while not list(endpoint_dir.glob("rank*.json")) and time.time() < deadline:
        time.sleep(0.02)
    endpoint = json.loads(next(endpoint_dir.glob("rank*.json")).read_text())
    with httpx.Client(timeout=30) as http:
        for k in range(2):
            run_auth = {"Authorization": f"Bearer {endpoint['run_key']}"}
            session = http.post(f"{endpoint['base_url']}/v1/sessions/claim", headers=run_auth).json()
            auth = {"Authorization": f"Bearer {session['api_key']}"}
            url = session["base_url"].removesuffix("/v1")
            reply = http.post(
                f"{url}/inference/v1/generate", json={"model": "policy", "token_ids": prompt}, headers=auth
            ).json()["choices"][0]
            generated = reply["token_ids"]
            logprobs = [e["logprob"] for e in reply["logprobs"]["content"]]
            mask = [False] * len(prompt) + [True] * len(generated)
            if k == 1:
                mask[-1] = False
            branch = {"token_ids": prompt + generated, "sampled_mask": mask, "logprobs": [0.0] * len(prompt) + logprobs}
            posted = http.post(f"{url}/reward", json={"reward": 0.5, "branches": [branch]}, headers=auth)
            statuses.append(posted.status_code)


def test_an_agents_record_of_its_trajectory_is_checked_token_for_token(tokenizer, tmp_path):
    endpoint_dir = tmp_path / "endpoint"
    prompt = ids(tokenizer, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    rollout = token_rollout(
        tokenizer, "", {0: [f"one{EOS}"], 1: [f"two{EOS}"]}, external=True, endpoint_dir=str(endpoint_dir)
    )
    statuses: list[int] = []
    agent = threading.Thread(target=_external_token_agent, args=(endpoint_dir, prompt, statuses))
    agent.start()
    batch = rollout.generate_sequences(rows(["x", "y"]), params(32))
    agent.join(timeout=60)
    assert statuses == [200, 200]
    failures = batch.non_tensor_batch[AGENT_FAILURE].tolist()
    assert failures[0] == "" and batch.non_tensor_batch[AGENT_REWARD][0] == 0.5
    assert "the masks differ" in failures[1]  # the second record marked one generated token as not sampled
