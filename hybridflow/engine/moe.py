"""The routers' statistics of a Hugging Face mixture of experts in the update: the load-balancing loss added to a
micro-batch's loss and each layer's expert loads as metrics.

The MoE layers are found by their parts (models/routing.py). ``RouterRecorder`` hooks the routers while an update
runs. Its statistic is the micro-batch's (the tokens one rank runs together, or under Ulysses the sp ranks' slices of
them, summed), as transformers computes it for a batch; a mini-batch's loss adds each micro-batch's, weighted by
1 / (its micro-batches) like a mean over them, and over the data-parallel ranks a mean too (engine/update.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hybridflow.algorithms.router_loss import balancing_loss_of, expert_loads_of, routing_statistics
from hybridflow.engine.sequence_parallel import ResponseShard, sum_over
from hybridflow.models.routing import configured_balancing_weight, routers


class RouterRecorder:
    """The routers' logits of the forwards since the last ``clear``."""

    def __init__(self, gates: list[nn.Module], top_k: int, coefficient: float) -> None:
        self.coefficient, self.top_k = coefficient, top_k
        self.logits: list[torch.Tensor] = []
        self.handles = [gate.register_forward_hook(self._record) for gate in gates]

    def _record(self, module: nn.Module, inputs, output) -> None:
        self.logits.append(output[0] if isinstance(output, tuple) else output)

    def clear(self) -> None:
        self.logits = []

    def loss_and_metrics(
        self, prefix: str, shard: ResponseShard | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The recorded forward's balancing loss (differentiable) and its metrics: the loss, and per layer the busiest
        expert's share of the choices relative to an even split (1: balanced; E / k at most). ``shard``: the forward
        ran this sequence-parallel rank's slice of the micro-batch; the statistics of its real tokens are summed over
        the slices (``sum_over``: each rank's routers receive sp times the gradient of the loss every rank computes
        alike, which FSDP's mean over the dp x sp ranks divides back, as for the policy loss)."""
        if not self.logits:
            raise RuntimeError("no router ran since the last clear: the forward did not pass through the MoE layers")
        logits = self.logits
        if shard is not None:
            logits = [layer[: shard.real_tokens] for layer in logits]  # the padding that evens the slices left out
        statistics = routing_statistics(logits, self.top_k)
        if shard is not None:
            statistics = sum_over(statistics, group=shard.group)
        return balancing_loss_and_metrics(statistics, prefix)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def balancing_loss_and_metrics(statistics: torch.Tensor, prefix: str) -> tuple[torch.Tensor, dict[str, float]]:
    """The balancing loss of a micro-batch's routing statistics (algorithms/router_loss.py, differentiable) and its
    metrics: the loss, and per layer the busiest expert's share of the choices relative to an even split (1: balanced;
    E / k at most)."""
    loss = balancing_loss_of(statistics)
    loads = expert_loads_of(statistics) * statistics.shape[-1]
    metrics = {f"{prefix}/router_aux_loss": float(loss.detach())}
    for layer, busiest in enumerate(loads.max(dim=1).values.tolist()):
        metrics[f"{prefix}/expert_load_max/layer_{layer}"] = busiest
    return loss, metrics


def aux_loss_coefficient(model: nn.Module, configured: float | None, gates: list[nn.Module] | None = None) -> float:
    """The balancing loss's weight: the configured one, or (None) the model config's ``router_aux_loss_coef``; 0 for a
    model without MoE layers (``gates``: its routers, when already found)."""
    if not (routers(model) if gates is None else gates):
        return 0.0
    return configured_balancing_weight(model.config, configured)


@contextmanager
def recording_routers(model: nn.Module, configured: float | None) -> Iterator[RouterRecorder | None]:
    """A recorder on the model's routers for the block (None: no MoE layers, or a zero weight)."""
    gates = routers(model)
    coefficient = aux_loss_coefficient(model, configured, gates)
    if coefficient == 0.0:
        yield None
        return
    recorder = RouterRecorder(gates, int(model.config.num_experts_per_tok), coefficient)
    try:
        yield recorder
    finally:
        recorder.remove()
