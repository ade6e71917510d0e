"""Mixture-of-experts routing statistics: the load-balancing loss and each layer's expert loads.

Both read the routers' logits, one (T, E) tensor per MoE layer over the same T tokens (real tokens only: packed rows
have no padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _choices(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's probabilities (T, E) and each token's top-k experts (T, k), as the families route."""
    probs = torch.softmax(logits.float(), dim=-1)
    return probs, probs.topk(top_k, dim=-1).indices


def routing_statistics(
    router_logits: Sequence[torch.Tensor], top_k: int, layers: int | None = None, first: int = 0
) -> torch.Tensor:
    """What the balancing loss and the expert loads read, as one (L + 2, E) float32 tensor that adds up over parts of
    the batch (sequence-parallel slices) and over parts of the model (pipeline stages): rows 0..L-1 each MoE layer's
    count of tokens that have expert e among their top k (``router_logits`` fill rows ``first``.., the rest stay 0),
    row L the router probabilities summed over the layers' tokens (differentiable), row L + 1 the number of tokens
    summed over the layers (in column 0). ``layers``: L, the model's MoE layers (default: those given)."""
    experts = router_logits[0].shape[-1]
    layers = len(router_logits) if layers is None else layers
    device = router_logits[0].device
    counts = torch.zeros(layers, experts, dtype=torch.float32, device=device)
    probability = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = 0
    for layer, logits in enumerate(router_logits):
        probs, chosen = _choices(logits, top_k)
        counts[first + layer] = torch.bincount(chosen.reshape(-1), minlength=experts).float()
        probability = probability + probs.sum(dim=0)
        rows += probs.shape[0]
    tokens = torch.zeros(1, experts, dtype=torch.float32, device=device)
    tokens[0, 0] = rows
    return torch.cat([counts, probability[None], tokens])


def balancing_loss_of(statistics: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer's balancing loss from ``routing_statistics`` with every MoE layer pooled into one
    statistic, as the Hugging Face families (Qwen3-MoE, OLMoE, Mixtral) define it: E · Σ_e f_e · P_e, where f_e is
    the share of tokens that have expert e among their top k (over all layers; summing to k over the experts) and P_e
    the mean router probability of e. Balanced routing gives k; all tokens on the same k experts with certainty gives
    E. Its gradient reaches the routers through P (f counts choices)."""
    counts, probability, rows = statistics[:-2].sum(dim=0), statistics[-2], statistics[-1, 0]
    return statistics.shape[-1] * torch.sum((counts / rows) * (probability / rows))


def expert_loads_of(statistics: torch.Tensor) -> torch.Tensor:
    """(L, E) from ``routing_statistics``: in each layer, the share of the tokens' expert choices that went to each
    expert (each row sums to 1; balanced routing gives 1/E everywhere)."""
    counts = statistics[:-2].detach()
    return counts / counts.sum(dim=1, keepdim=True)
