"""The experts a mixture of experts chose for each token of one ``Engine.generate`` call (routing replay,
models/routing.py): filled from the forwards' records (model.py ``record``) as the call runs, read as the batch's
``routed_experts`` at its end.

Each request's positions count its tokens: its prompt 0..P_i-1, then response token j at P_i + j. A forward's record
is one (tokens, k) tensor per MoE layer, its tokens in the forward's row-major order.
"""

from __future__ import annotations

import torch

from hybridflow.models.routing import ROUTE_DTYPE


def by_token(record: list[torch.Tensor]) -> torch.Tensor:
    """A forward's record -> (tokens, layers, k)."""
    return torch.stack(record, dim=1).to(ROUTE_DTYPE)


class RouteLog:
    """(requests, positions, layers, k) expert indices, -1 where no forward has run the position."""

    def __init__(self, requests: int, positions: int, layers: int, top_k: int, device: torch.device):
        self.routes = torch.full((requests, positions, layers, top_k), -1, dtype=ROUTE_DTYPE, device=device)
        self.prefix = self.routes.new_empty(0, layers, top_k)  # the prompts' common prefix, run once

    def shared_prefix(self, record: list[torch.Tensor]) -> None:
        """The common prefix's forward (one row of its tokens): every request's first positions."""
        self.prefix = by_token(record)

    def prompts(self, record: list[torch.Tensor], width: int, lengths: list[int], requests: list[list[int]]) -> None:
        """A prefill over rows of ``width`` right-padded tokens after the shared prefix: row r holds positions
        len(prefix)..lengths[r]-1 of each of ``requests[r]`` (the n samples of a prompt share its row)."""
        rows = by_token(record).view(len(lengths), width, *self.prefix.shape[1:])
        start = len(self.prefix)
        for row, (length, members) in enumerate(zip(lengths, requests)):
            members_t = torch.tensor(members, device=self.routes.device)
            self.routes[members_t, :start] = self.prefix
            self.routes[members_t, start:length] = rows[row, : length - start]

    def tokens(self, record: list[torch.Tensor], requests: torch.Tensor, positions: torch.Tensor) -> None:
        """A decode step: token b of ``requests[b]`` at ``positions[b]``."""
        self.routes[requests, positions] = by_token(record)

    def batch_rows(self, prompt_width: int, prompt_lengths: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The routes in the batch's layout (B, P+R, layers, k): each prompt left-padded to ``prompt_width`` columns,
        its response after it; -1 on padding and on positions no forward ran (each response's last token)."""
        rows, width = attention_mask.shape
        device = self.routes.device
        position = torch.arange(width, device=device)[None, :] - (prompt_width - prompt_lengths.to(device))[:, None]
        inside = (position >= 0) & (position < self.routes.shape[1]) & attention_mask.bool().to(device)
        routes = self.routes[torch.arange(rows, device=device)[:, None], position.clamp(0, self.routes.shape[1] - 1)]
        return routes.masked_fill(~inside[:, :, None, None], -1)
