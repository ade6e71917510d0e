"""The routes of agent-loop trajectories in the batch's layout (rollout/agent/rollout.py ``trajectory_routes``),
by hand: left-padded prompts, routes cut at the row's context and at the response budget, -1 where none."""

import torch

from hybridflow.models.routing import ROUTE_DTYPE
from hybridflow.rollout.agent.rollout import trajectory_routes
from hybridflow.rollout.agent.state import Trajectory


def routes_from(first: int, positions: int) -> torch.Tensor:
    """(positions, layers=1, k=2): position i holds experts (first + i, first + i + 100)."""
    index = torch.arange(first, first + positions)
    return torch.stack([index, index + 100], dim=-1)[:, None, :].to(ROUTE_DTYPE)


def test_trajectory_routes_by_hand():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
    rows = [
        # prompt 2 + 3 tokens; the engine computed 4 positions (not the last token)
        Trajectory(request=0, prompt=[5, 6], tokens=[1, 2, 3], routes=routes_from(10, 4)),
        # prompt 3 + 2 tokens; the engine holds 7 positions (a stop string cut the turn): cut at the context's 5
        Trajectory(request=1, prompt=[5, 6, 7], tokens=[1, 2], routes=routes_from(20, 7)),
        # failed before any turn: nothing recorded
        Trajectory(request=2, prompt=[5], tokens=[]),
        # prompt 3 + 6 tokens, 4 of them in the response budget: cut at 3 + 4
        Trajectory(request=3, prompt=[5, 6, 7], tokens=[1, 2, 3, 4, 5, 6], routes=routes_from(30, 8)),
    ]
    routes = trajectory_routes(prompt_mask, rows, response_length=4, route_shape=(1, 2))
    assert routes.shape == (4, 7, 1, 2) and routes.dtype == ROUTE_DTYPE
    first = routes[:, :, 0, 0].tolist()
    assert first[0] == [-1, 10, 11, 12, 13, -1, -1]
    assert first[1] == [20, 21, 22, 23, 24, -1, -1]
    assert first[2] == [-1] * 7
    assert first[3] == [30, 31, 32, 33, 34, 35, 36]
    assert routes[0, 1, 0].tolist() == [10, 110]
