"""Agents that speak the token route (POST /inference/v1/generate), as training clients that render their own
prompts do: token ids in, token ids and log-probs out. The prompt and the inserted tails come in the row's
extra_info (a client renders them itself)."""

from __future__ import annotations

import json

import httpx


def generate(http: httpx.Client, base_url: str, api_key: str, token_ids: list[int], **sampling) -> dict:
    url = base_url.removesuffix("/v1") + "/inference/v1/generate"
    body = {"model": "policy", "token_ids": token_ids, "sampling_params": {"logprobs": 1, **sampling}}
    response = http.post(url, json=body, headers={"Authorization": f"Bearer {api_key}", "X-Session-ID": "trace-1"})
    response.raise_for_status()
    return response.json()


def two_turn_token_agent(base_url: str, api_key: str, row: dict) -> float:
    """A turn on the prompt's ids, then a turn on prompt + the reply + a user tail (extends the branch), then, with
    extra_info["diverge"], a turn on an edited context (a new branch). Every reply is written to extra_info["out"]."""
    extra = row["extra_info"]
    replies = []
    with httpx.Client(timeout=30) as http:
        first = generate(http, base_url, api_key, extra["prompt_ids"], stop_token_ids=extra["stop_ids"])
        replies.append(first)
        context = extra["prompt_ids"] + first["choices"][0]["token_ids"] + extra["tail_ids"]
        replies.append(generate(http, base_url, api_key, context, max_tokens=8))
        if extra.get("diverge"):
            replies.append(generate(http, base_url, api_key, extra["prompt_ids"] + extra["tail_ids"]))
    with open(extra["out"], "w") as file:
        json.dump(replies, file)
    return 1.0


def bad_token_requests_agent(base_url: str, api_key: str, row: dict) -> float:
    """Bad token requests of every kind, each status and error code recorded in extra_info["out"]; then a good one."""
    extra = row["extra_info"]
    root, url = base_url.split("/sessions/")[0], base_url.removesuffix("/v1") + "/inference/v1/generate"
    auth = {"Authorization": f"Bearer {api_key}"}
    good = {"model": "policy", "token_ids": extra["prompt_ids"], "sampling_params": {"max_tokens": 4}}
    statuses = {}
    with httpx.Client(timeout=30) as http:

        def post(name, body=None, target=url, headers=None, **kwargs):
            response = http.post(target, json=body, headers=auth if headers is None else headers, **kwargs)
            statuses[name] = [response.status_code, response.json()["error"]["code"]]

        def sampling(**changes):
            return {**good, "sampling_params": {**good["sampling_params"], **changes}}

        post("no key", good, headers={})
        post("wrong key", good, headers={"Authorization": "Bearer hf-not-a-key"})
        post("unknown session", good, target=f"{root}/sessions/nope/inference/v1/generate")
        post("malformed JSON", content=b'{"token_ids": [1,', headers={**auth, "Content-Type": "application/json"})
        post("not an object", [1, 2])
        post("unknown model", {**good, "model": "gpt-4o"})
        post("no token ids", {"model": "policy"})
        post("empty token ids", {**good, "token_ids": []})
        post("token id not an integer", {**good, "token_ids": [1, "two"]})
        post("token id out of the vocabulary", {**good, "token_ids": [1, 10**9]})
        post("negative token id", {**good, "token_ids": [-1]})
        post("prompt too long", {**good, "token_ids": extra["prompt_ids"] * 100})
        post("max_tokens over the budget", sampling(max_tokens=100000))
        post("max_tokens not positive", sampling(max_tokens=0))
        post("other temperature", sampling(temperature=0.3))
        post("other top_p", sampling(top_p=0.5))
        post("top_k", sampling(top_k=5))
        post("repetition penalty", sampling(repetition_penalty=1.3))
        post("n > 1", sampling(n=2))
        post("top logprobs", sampling(logprobs=5))
        post("stop strings", sampling(stop=["\n"]))
        post("unknown sampling parameter", sampling(frobnicate=1))
        post("unknown parameter", {**good, "frobnicate": 1})
        post("multimodal", {**good, "features": {"pixel_values": [0.0]}})
        post("stop ids out of the vocabulary", sampling(stop_token_ids=[10**9]))
        post("body too large", {**good, "padding": "x" * 2_000_000})
        post("not JSON content type", content=b"hello", headers={**auth, "Content-Type": "text/plain"})
        response = http.get(url, headers=auth)
        statuses["wrong method"] = [response.status_code, response.json()["error"]["code"]]
        response = http.post(url, json=good, headers=auth)
        statuses["good"] = [response.status_code, response.json()["choices"][0]["finish_reason"]]
        models = http.get(f"{base_url}/models", headers=auth).json()["data"][0]
    with open(extra["out"], "w") as file:
        json.dump({"statuses": statuses, "models": models}, file)
    return 1.0
