"""Mixture-of-experts routing statistics: the load-balancing loss and each layer's expert loads.

Both read the routers' logits, one (T, E) tensor per MoE layer over the same T tokens (real tokens only: packed rows
have no padding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _choices(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's probabilities (T, E) and each token's top-k experts (T, k), as the families route."""
    probs = torch.softmax(logits.float(), dim=-1)
    return probs, probs.topk(top_k, dim=-1).indices


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], top_k: int, sum_parts: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """The Switch Transformer's balancing loss with every MoE layer pooled into one statistic, as the Hugging Face
    families (Qwen3-MoE, OLMoE, Mixtral) define it: E · Σ_e f_e · P_e, where f_e is the share of tokens that have
    expert e among their top k (over all layers; summing to k over the experts) and P_e the mean router probability
    of e. Balanced routing gives k; all tokens on the same k experts with certainty gives E. Its gradient reaches the
    routers through P (f counts choices).

    ``sum_parts``: the tokens are one part of the batch's (a sequence-parallel rank's slice); it sums a tensor of
    statistics over the parts (differentiably), so that the loss is the whole batch's."""
    experts = router_logits[0].shape[-1]
    counts = torch.zeros(experts, dtype=torch.float32, device=router_logits[0].device)
    probability = torch.zeros_like(counts)
    rows = torch.zeros((), dtype=torch.float32, device=counts.device)
    for logits in router_logits:
        probs, chosen = _choices(logits, top_k)
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=experts).float()
        probability = probability + probs.sum(dim=0)
        rows = rows + probs.shape[0]
    if sum_parts is not None:
        counts, probability, rows = sum_parts(counts), sum_parts(probability), sum_parts(rows)
    return experts * torch.sum((counts / rows) * (probability / rows))


def expert_loads(
    router_logits: Sequence[torch.Tensor], top_k: int, sum_parts: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """(L, E): in each layer, the share of the tokens' expert choices that went to each expert (each row sums to 1;
    balanced routing gives 1/E everywhere). ``sum_parts``: as ``load_balancing_loss``'s."""
    with torch.no_grad():
        counts = torch.stack(
            [
                torch.bincount(_choices(logits, top_k)[1].reshape(-1), minlength=logits.shape[-1]).float()
                for logits in router_logits
            ]
        )
        if sum_parts is not None:
            counts = sum_parts(counts)
    return counts / counts.sum(dim=1, keepdim=True)
