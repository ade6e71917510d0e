"""A Hugging Face mixture of experts' layers found by their parts, and routing replay: a forward that sends each
token to experts recorded elsewhere.

A MoE block has a ``gate`` (the router: its forward returns (logits (T, E), top-k weights, top-k experts)) and
``experts`` with the fused 3-D expert weights (Qwen3-MoE, OLMoE, Mixtral).

Why replay: the rollout and the trainer compute the same router on the same weights, but not bit for bit (another
kernel, another batch shape, bf16 against fp32). Where a token's k-th and (k+1)-th experts are nearly tied, the two
pick different experts, and the token's output, and every later token's through attention, moves far more than the
rounding that caused it: the trainer's log-probs then differ from those of the rollout that sampled them. Replay makes
the trainer route each token through the experts the rollout chose (verl and NeMo RL call this R3: rollout routing
replay). Only the choice is replayed: the routing weights come from the trainer's own router logits at the recorded
experts (softmax over all experts, gathered, renormalised as the family does), so the router still learns.

Routes travel as ``routed_experts`` (batch_keys.py): (B, P+R, L, k) integers, each position's k experts in each of
the L MoE layers, -1 where none was recorded (padding; the last response token, which generation never feeds back);
a token with -1 routes itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # Hugging Face's fused expert weights, experts on dimension 0
ROUTE_DTYPE = torch.int16  # expert indices as stored in a batch; -1: not recorded


def configured_balancing_weight(config, configured: float | None) -> float:
    """The routers' balancing-loss weight of a mixture whose Hugging Face config is ``config``: ``configured``, or
    (None) the config's own ``router_aux_loss_coef`` (0 where it has none)."""
    if configured is not None:
        return float(configured)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The model's experts modules (one per MoE layer): those with Hugging Face's fused 3-D expert weights."""
    found = []
    for module in model.modules():
        weights = [getattr(module, name, None) for name in EXPERT_WEIGHTS]
        if all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
            found.append(module)
    return found


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of each MoE layer, in layer order."""
    experts = {id(module) for module in experts_modules(model)}
    return [
        m.gate for m in model.modules() if id(_unwrapped(getattr(m, "experts", None))) in experts and hasattr(m, "gate")
    ]


def _unwrapped(module: nn.Module | None) -> nn.Module | None:
    """A module under the adapter wrappers around it (peft's ``base_layer`` chain: LoRA on the experts)."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def replayed_choice(
    logits: torch.Tensor, recorded: torch.Tensor, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights and experts (each (T, k)) of router logits (T, E) when each token goes to its ``recorded``
    experts (T, k), or where they hold -1 to its own top k: softmax over every expert in fp32, the chosen experts'
    probabilities, renormalised to sum to 1 when the family does, in ``dtype``. With the token's own choice recorded
    this is exactly the router's output."""
    probs = torch.softmax(logits.float(), dim=-1)
    own = probs.topk(recorded.shape[-1], dim=-1).indices
    known = (recorded >= 0).all(dim=-1, keepdim=True)
    experts = torch.where(known, recorded.long(), own)
    weights = probs.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def renormalizes(gate: nn.Module) -> bool:
    """Whether the family renormalises the top-k weights (Mixtral always; Qwen3-MoE and OLMoE by their config)."""
    return bool(getattr(gate, "norm_topk_prob", True))


@dataclass
class RouteReplay:
    """Routing replay in a pass (``replaying_routes``): the routes it replayed, each a (token, MoE layer), and how
    many of them the model's own router would have chosen otherwise (the routing mismatch replay removes)."""

    replayed: int = 0
    changed: int = 0

    def count(self, own: torch.Tensor, replayed: torch.Tensor, known: torch.Tensor) -> None:
        """Count a layer's routes: the router's ``own`` and the ``replayed`` experts (T, k), ``known`` (T, 1)."""
        differs = (own.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1, keepdim=True)
        self.replayed += int(known.sum())
        self.changed += int((differs & known).sum())

    def metrics(self, pass_name: str, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """``router_replay/changed_<pass_name>``: the share of the routes replayed since the last call that differ
        from the model's own choice (nothing when none was replayed); the counts start again. ``group``: ranks that
        each replayed other layers (pipeline stages), whose counts are summed first (every rank of it calls this)."""
        if group is not None:
            counts = torch.tensor([self.replayed, self.changed], dtype=torch.int64)
            dist.all_reduce(counts, group=group)
            self.replayed, self.changed = (int(c) for c in counts)
        if not self.replayed:
            return {}
        share = self.changed / self.replayed
        self.replayed = self.changed = 0
        return {f"router_replay/changed_{pass_name}": share}


@contextmanager
def replaying_routes(
    model: nn.Module, routes: torch.Tensor | None, replay: RouteReplay | None = None
) -> Iterator[None]:
    """Within the block, the model's MoE layers route the tokens of each forward by ``routes`` (T, L, k): one row per
    token the forward runs (in the order its hidden states are flattened), one column per MoE layer; ``replay``
    counts what changed. None: the model routes itself."""
    if routes is None:
        yield
        return
    gates = routers(model)
    if routes.dim() != 3 or routes.shape[1] != len(gates):
        raise ValueError(
            f"routing replay: routes of shape {tuple(routes.shape)} for a model with {len(gates)} MoE layers "
            "(expected (tokens, layers, k))"
        )

    def replay_layer(layer: int):
        def hook(gate: nn.Module, inputs, output):
            logits, weights, experts = output
            recorded = routes[:, layer].to(logits.device)
            if recorded.shape != experts.shape:
                raise ValueError(
                    f"routing replay: MoE layer {layer} routes {tuple(experts.shape)} (tokens, k) but "
                    f"{tuple(recorded.shape)} were recorded: the batch's routes do not match the forward's tokens"
                )
            replayed_weights, replayed = replayed_choice(logits, recorded, renormalizes(gate), weights.dtype)
            if replay is not None:
                replay.count(experts, replayed, (recorded >= 0).all(dim=-1, keepdim=True))
            return logits, replayed_weights, replayed

        return hook

    handles = [gate.register_forward_hook(replay_layer(layer)) for layer, gate in enumerate(gates)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RouteRecorder:
    """The experts each MoE layer chose in the forwards since it started: ``routes()`` gives one (T, L, k) tensor per
    forward (T its tokens, L the layers)."""

    def __init__(self, model: nn.Module):
        self.gates = routers(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.gates]
        self.handles = [gate.register_forward_hook(self._hook(layer)) for layer, gate in enumerate(self.gates)]

    def _hook(self, layer: int):
        def hook(gate: nn.Module, inputs, output) -> None:
            self.calls[layer].append(output[2].detach().to(ROUTE_DTYPE))

        return hook

    def routes(self) -> list[torch.Tensor]:
        if len({len(calls) for calls in self.calls}) > 1:
            raise RuntimeError("routing record: the MoE layers ran different numbers of forwards")
        return [torch.stack(layers, dim=1) for layers in zip(*self.calls)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextmanager
def recording_routes(model: nn.Module) -> Iterator[RouteRecorder]:
    """A ``RouteRecorder`` on the model's MoE layers for the block."""
    recorder = RouteRecorder(model)
    try:
        yield recorder
    finally:
        recorder.remove()


@contextmanager
def routes_into(
    model: nn.Module, out: list[torch.Tensor] | None, to_rows: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """Within the block (one forward), the experts the model's MoE layers chose, (T, L, k) by the forward's tokens,
    appended to ``out`` as ``to_rows`` lays them out (None: nothing recorded)."""
    if out is None:
        yield
        return
    with recording_routes(model) as recorder:
        yield
    (routes,) = recorder.routes()
    out.append(to_rows(routes))


def rows_of_tokens(routes: torch.Tensor, token_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Routes of a forward's tokens (N, L, k) in the rows' layout (b, S, L, k): each real token's from its position
    among the forward's (``token_position`` (b, S)), -1 where ``mask`` (b, S) is 0."""
    rows = routes[token_position.clamp(min=0, max=routes.shape[0] - 1)]
    return rows.masked_fill(~mask.bool()[:, :, None, None], -1)
