"""Every branch of a session trained: a session's branches as rows of the batch.

A session's requests either extend one of its branches or start a new one (sessions.py): an agent that edits its
history, or a chat template that renders earlier turns differently from how the model produced them (verifiers'
default renderer drops a reply's reasoning), starts a branch at each such request. Every branch holds tokens the
model really generated, with their log-probs; a session is therefore trained on all of them, not only on its last.

- On the generating rank, ``branch_trajectory`` makes a branch a trajectory (the session's last branch is the
  sample's row, as before) and ``other_branch_rows`` lays out the session's other branches, those with generated
  tokens, as rows of the batch's shape; the rollout hands them in ``AGENT_BRANCH_ROWS``, one entry per sample, so
  that a generation call still returns one row per request (its dispatch and padding are unchanged).
- On the driver, ``expand_branches`` makes each of them a row of its session's group: the sample row's prompt data,
  uid and reward (the session's: a branch's reward is its session's, as in step-wise training where a trajectory's
  steps share its outcome), tagged with ``SESSION`` and ``LAST_BRANCH`` (False). The advantage of a group estimator
  (GRPO, RLOO, ...) compares sessions, not branches: it is computed on the last branches, one per session, and each
  other branch gets its session's (algorithms/branch_advantage.py), as rLLM's and SkyRL's step-wise modes broadcast
  a trajectory's advantage to its steps; an estimator without groups (GAE) takes each branch as a trajectory of its
  own with the session's reward at its end.
- A batch grown by branches is padded for the update (``pad_to_planned``) with inert rows (one prompt token, no
  response: nothing to train, nothing to count) up to a whole multiple of the planned batch, and every optimizer
  step's mini-batch grows by that multiple (``BATCH_SCALE``): the optimizer steps of a step stay as planned.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.batch_keys import (
    AGENT_BRANCH_ROWS,
    ATTENTION_MASK,
    GENERATED_MASK,
    LAST_BRANCH,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    SESSION,
    STOP_REASON,
    TOKEN_LEVEL_SCORES,
    UID,
)
from hybridflow.protocol import DataProto
from hybridflow.rollout.agent.rollout import assemble_trajectories
from hybridflow.rollout.agent.state import STOP_LENGTH, STOP_NO_TOOL_CALL, RequestState, Trajectory
from hybridflow.rollout.agent_server.sessions import Branch, Session

FILLER_SESSION = ""  # the SESSION of a row that pads a batch for the update (pad_to_planned)


def branch_trajectory(index: int, branch: Branch | None, pad_token_id: int, failure: str = "") -> Trajectory:
    """The trajectory of one branch (None: a session that made no request, a one-token prompt), failed with
    ``failure`` if given."""
    trajectory = Trajectory(request=index, prompt=branch.prompt if branch is not None else [pad_token_id])
    if branch is not None:
        trajectory.tokens, trajectory.mask, trajectory.log_probs = branch.tokens, branch.mask, branch.log_probs
        trajectory.routes = branch.routes
        trajectory.turn_ends = list(branch.turn_ends)
        trajectory.turn_scores = [0.0] * len(branch.turn_ends)
        trajectory.assistant_turns = len(branch.turn_ends)
        trajectory.user_turns = max(0, len(branch.turn_ends) - 1)
    if failure or branch is None:
        trajectory.fail(failure or "the session made no request")
    else:
        trajectory.move_to(RequestState.GENERATING)
        trajectory.finish(STOP_LENGTH if branch.finish_reason == "length" else STOP_NO_TOOL_CALL)
    return trajectory


def other_branches(session: Session) -> list[Branch]:
    """The session's branches other than its last, those holding any generated token, in the order they started."""
    return [b for b in session.branches if b is not session.last and any(b.mask)]


def left_padded(prompts: list[list[int]], pad: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to ``width`` columns: (ids, mask)."""
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


def other_branch_rows(
    session: Session,
    *,
    prompt_width: int,
    response_length: int,
    pad_token_id: int,
    route_shape: tuple[int, int] | None = None,
) -> dict[str, dict[str, Any]] | None:
    """The session's other branches (``other_branches``) as rows of the batch's shape: {"tensors": {key: (k, ...)},
    "non_tensors": {key: (k,) objects}}; None when it has none. ``route_shape``: as `assemble_trajectories`."""
    branches = other_branches(session)
    if not branches:
        return None
    trajectories = [branch_trajectory(session.index, b, pad_token_id) for b in branches]
    for trajectory in trajectories:
        trajectory.tool_calls = 0  # the session's tool calls are counted once, on its row
    prompt_ids, prompt_mask = left_padded([t.prompt for t in trajectories], pad_token_id, prompt_width)
    tensors, non_tensors = assemble_trajectories(
        prompt_ids, prompt_mask, trajectories, response_length, pad_token_id, route_shape
    )
    return {"tensors": tensors, "non_tensors": non_tensors}


def expand_branches(batch: DataProto) -> DataProto:
    """``batch`` with each row's other branches (``AGENT_BRANCH_ROWS``, taken out) as rows after it, every row
    tagged with its ``SESSION`` and ``LAST_BRANCH``; ``batch`` itself when it has no such column."""
    payloads = batch.non_tensor_batch.pop(AGENT_BRANCH_ROWS, None)
    if payloads is None:
        return batch
    size = len(batch)
    uids = batch.non_tensor_batch[UID]
    batch.non_tensor_batch[SESSION] = np.array([f"{uids[i]}/{i}" for i in range(size)], dtype=object)
    batch.batch[LAST_BRANCH] = torch.ones(size, dtype=torch.bool)
    counts = np.array([len(p["non_tensors"][STOP_REASON]) if p else 0 for p in payloads], dtype=np.int64)
    if not counts.any():
        return batch
    # one gather: each row, then as many copies of it as it has other branches, which its payload then overwrites
    expanded = batch[np.repeat(np.arange(size), 1 + counts)]
    starts = np.concatenate([[0], np.cumsum(1 + counts)[:-1]])
    tensors, objects = expanded.batch, expanded.non_tensor_batch
    for i in np.flatnonzero(counts):
        rows = slice(int(starts[i]) + 1, int(starts[i] + 1 + counts[i]))
        for key, value in payloads[i]["tensors"].items():
            tensors[key][rows] = value.to(tensors[key].device)
        for key, value in payloads[i]["non_tensors"].items():
            objects[key][rows] = value
        tensors[LAST_BRANCH][rows] = False
        if GENERATED_MASK in tensors.keys():  # marked on the generated batch: each branch's own tokens
            tensors[GENERATED_MASK][rows] = tensors[RESPONSE_MASK][rows]
    expanded.meta_info = dict(batch.meta_info)
    return expanded


def pad_to_planned(batch: DataProto, planned: int) -> int:
    """Pad a branching batch (in place) with inert rows to a whole multiple of ``planned`` rows; returns that
    multiple (1 for a batch of the planned size or smaller, whose size the plan already divides)."""
    if SESSION not in batch.non_tensor_batch or len(batch) <= planned:
        return 1
    scale = -(-len(batch) // planned)
    count = scale * planned - len(batch)
    if count:
        fillers = batch[np.zeros(count, dtype=np.int64)]
        tensors = fillers.batch
        response_length = tensors[RESPONSES].shape[1]
        attention = torch.zeros_like(tensors[ATTENTION_MASK])
        attention[:, -response_length - 1] = 1  # the prompt's last token, which every left-padded prompt has
        tensors[ATTENTION_MASK] = attention
        tensors[POSITION_IDS] = torch.zeros_like(tensors[POSITION_IDS])
        for key in (RESPONSE_MASK, GENERATED_MASK, ROLLOUT_LOG_PROBS, TOKEN_LEVEL_SCORES):
            if key in tensors.keys():
                tensors[key] = torch.zeros_like(tensors[key])
        tensors[LAST_BRANCH] = torch.zeros(count, dtype=torch.bool)
        fillers.non_tensor_batch[SESSION] = np.array([FILLER_SESSION] * count, dtype=object)
        whole = DataProto.concat([batch, fillers])
        batch.batch, batch.non_tensor_batch = whole.batch, whole.non_tensor_batch
    return scale


def drop_fillers(batch: DataProto) -> None:
    """Remove (in place) the rows ``pad_to_planned`` added."""
    if SESSION not in batch.non_tensor_batch:
        return
    keep = np.flatnonzero(batch.non_tensor_batch[SESSION] != FILLER_SESSION)
    if len(keep) < len(batch):
        kept = batch[keep]
        batch.batch, batch.non_tensor_batch = kept.batch, kept.non_tensor_batch
