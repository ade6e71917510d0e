"""An agent in another process: it finds the run's endpoint in the endpoint directory, claims sessions with the run's
key, answers each with the openai SDK, and posts the reward (the reply's length in characters, divided by 100).

    python external_agent.py ENDPOINT_DIR SESSIONS OUT_JSON
"""

import json
import sys
import time
from pathlib import Path

import httpx
import openai


def main() -> None:
    directory, wanted, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    deadline, done, checks = time.time() + 120, [], {}
    while len(done) < wanted and time.time() < deadline:
        files = sorted(directory.glob("rank*.json"))
        if not files:
            time.sleep(0.05)
            continue
        endpoint = json.loads(files[0].read_text())
        try:
            claimed = httpx.post(
                f"{endpoint['base_url']}/v1/sessions/claim", headers={"Authorization": f"Bearer {endpoint['run_key']}"}
            )
        except httpx.TransportError:  # the endpoint stopped between two reads
            time.sleep(0.05)
            continue
        if claimed.status_code == 204:
            time.sleep(0.05)
            continue
        session = claimed.json()
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=session["row"]["raw_prompt"])
        text = reply.choices[0].message.content or ""
        auth = {"Authorization": f"Bearer {session['api_key']}"}
        reward_url = session["base_url"].removesuffix("/v1") + "/reward"
        if not checks:  # the bad requests an external agent can make, once
            checks["claim with a session key"] = httpx.post(
                f"{endpoint['base_url']}/v1/sessions/claim", headers=auth
            ).status_code
            checks["reward not a number"] = httpx.post(reward_url, json={"reward": "high"}, headers=auth).status_code
            checks["reward without a key"] = httpx.post(reward_url, json={"reward": 1.0}).status_code
        posted = httpx.post(reward_url, json={"reward": len(text) / 100, "metrics": {"chars": len(text)}}, headers=auth)
        if "reward after close" not in checks:  # on the first session, while the others keep the endpoint up
            checks["reward after close"] = httpx.post(reward_url, json={"reward": 1.0}, headers=auth).status_code
        done.append({"session": session["session_id"], "row": session["row"]["index"], "text": text,
                     "status": posted.status_code})  # fmt: skip
    out.write_text(json.dumps({"done": done, "checks": checks}))


if __name__ == "__main__":
    main()
