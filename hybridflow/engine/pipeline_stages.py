"""Pipeline stages: a copy of a transformers model that keeps its share of the decoder layers (engine/pipeline.py
runs them). The layers it does not hold become ``AbsentLayer``, so every parameter keeps the unsplit model's name;
the first stage holds the embedding, the last the final norm and the head, and a stage's ``forward`` takes what the
stage before it sent (``StageForward``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms.router_loss import routing_statistics
from hybridflow.engine.fsdp import AbsentLayer, decoder_layers
from hybridflow.engine.packing import PackedBatch, SequenceShards, use_packed_attention
from hybridflow.engine.sequence_parallel import sp_size, sum_over
from hybridflow.models.routing import ROUTE_DTYPE, RouteReplay, experts_modules, replaying_routes, routers

PIPELINE_DIM = "pp"  # the mesh dimension over which stages are split
LossOfOutputs = Callable[[int, torch.Tensor], torch.Tensor]  # (micro-batch index, the last stage's output) -> loss
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def decoder_layer_index(name: str) -> int | None:
    """The decoder layer a Hugging Face tensor name belongs to (``model.layers.3.mlp...``: 3); None: not a layer's
    (the embedding, the final norm, the head)."""
    match = _LAYER_NAME.search(name)
    return int(match.group(1)) if match else None


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each stage: ``num_layers / num_stages`` consecutive ones each (ValueError unless it
    divides)."""
    if num_stages < 1 or num_layers % num_stages:
        raise ValueError(f"{num_layers} decoder layers do not split into {num_stages} pipeline stages of equal size")
    per_stage = num_layers // num_stages
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(num_stages)]


def local_stages(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages of pp rank ``pp_rank``: ``pp_rank + k * pp_size`` (torch's looped placement for interleaved 1F1B)."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def _parent_of_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder stack (the module holding the layers, the embedding and the final norm) and its layer list."""
    layers = decoder_layers(model)
    for module in model.modules():
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) and child[0] is layers[0]:
                return module, child
    raise ValueError(f"{type(model).__name__} has no decoder layers to split into pipeline stages")


def head_name(model: nn.Module) -> str:
    for name in ("lm_head", "score"):
        if any(n.split(".")[-1] == name for n, _ in model.named_modules()):
            return name
    raise ValueError(f"{type(model).__name__} has neither an LM head nor a score head")


def submodule_named(model: nn.Module, leaf: str) -> tuple[nn.Module, str]:
    """The parent of the shortest-named module whose name ends in ``leaf`` (under LoRA: peft's wrapper), and its
    attribute name."""
    name = min((n for n, _ in model.named_modules() if n.split(".")[-1] == leaf), key=len)
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return parent, leaf


@dataclass(frozen=True)
class RoutingShape:
    """A mixture's routing statistics as its stages carry them (algorithms/router_loss.py ``routing_statistics``):
    its routers' top k, its MoE layers (all stages'), its experts."""

    top_k: int
    layers: int
    experts: int


@dataclass
class MicroInputs:
    """The micro-batches of the pass under way, as every stage of this rank reads them: each one's packed tokens
    (padded to the pass's length), how many of them are real (the rest are filler), and the packed positions the last
    stage reads the head at; with routing replay, each one's recorded experts (tokens, every MoE layer, k; None: routed
    by the model) and the replay's counts. ``routing``: the stages carry their routing statistics (the balancing
    loss in training); ``recording``: the experts they routed each token to (forward only)."""

    packed: list[PackedBatch]
    select: list[torch.Tensor]
    real_tokens: list[int] = field(default_factory=list)
    routes: list[torch.Tensor | None] = field(default_factory=list)
    replay: RouteReplay | None = None
    routing: RoutingShape | None = None
    recording: RoutingShape | None = None
    shards: SequenceShards | None = None  # Ulysses: the whole sequence each rank's slice belongs to

    def clear(self) -> None:
        """No pass under way."""
        self.packed, self.select, self.real_tokens, self.routes = [], [], [], []
        self.replay = self.routing = self.recording = self.shards = None


class StageForward:
    """A stage's forward (the stage model's ``forward``): the first stage embeds the ids, the others take the hidden
    states of the stage before; the last applies the final norm and the head at the selected positions, (M, C).

    A mixture's stages may carry one more tensor after the hidden states, to which each adds what its MoE layers
    (``gates``) give, so that the last stage's is the whole model's:
    - ``inputs.routing`` (training): the routing statistics over the real tokens, from which the last stage computes
      the balancing loss, whose gradient reaches each stage's routers back through the sends;
    - ``inputs.recording`` (forward only): the experts each token was routed to, (tokens, every MoE layer, k).
    """

    def __init__(
        self,
        stack: nn.Module,
        head: nn.Module | None,
        first: bool,
        inputs: MicroInputs,
        moe_layers: slice,
        gates: list[nn.Module],
    ):
        self.stack, self.head, self.first, self.inputs = stack, head, first, inputs
        self.moe_layers = moe_layers  # the stage's MoE layers among the whole model's (routing replay's columns)
        self.gates = gates

    def __call__(
        self, x: torch.Tensor, *carried: torch.Tensor, micro: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        index = int(micro.reshape(-1)[0])
        packed = self.inputs.packed[index]
        ids = packed.input_ids
        common = dict(
            attention_mask=torch.ones_like(ids),
            position_ids=packed.position_ids,
            packed_segments=packed.segments,
            use_cache=False,
        )
        if self.inputs.shards is not None:
            common["sequence_shards"] = self.inputs.shards
        routes = self.inputs.routes[index] if index < len(self.inputs.routes) else None
        routing, recording = self.inputs.routing, self.inputs.recording
        gate_outputs: list[tuple[torch.Tensor, ...]] = []
        hooks = []
        if routing is not None or recording is not None:
            hooks = [gate.register_forward_hook(lambda m, i, out: gate_outputs.append(out)) for gate in self.gates]
        try:
            with replaying_routes(
                self.stack, None if routes is None else routes[:, self.moe_layers], self.inputs.replay
            ):
                if self.first:
                    hidden = self.stack(input_ids=x, **common).last_hidden_state
                else:
                    hidden = self.stack(inputs_embeds=x, **common).last_hidden_state
        finally:
            for hook in hooks:
                hook.remove()
        output = hidden if self.head is None else self.head(hidden[0, self.inputs.select[index]])
        if routing is not None:
            return output, self._statistics(routing, [out[0] for out in gate_outputs], index, carried)
        if recording is not None:
            chosen = [out[2] for out in gate_outputs]  # (tokens, k) a layer: the routers' top-k indices
            return output, self._routes(recording, chosen, ids.shape[1], carried)
        return output

    def _statistics(
        self, routing: RoutingShape, logits: list[torch.Tensor], index: int, carried: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """The stage before's routing statistics (none at the first) plus this stage's layers' over the real
        tokens (the filler that evens the micro-batches left out)."""
        real = self.inputs.real_tokens[index]
        if logits and real:
            real_logits = [layer[:real] for layer in logits]
            mine = routing_statistics(real_logits, routing.top_k, routing.layers, self.moe_layers.start)
        else:
            mine = torch.zeros(routing.layers + 2, routing.experts, device=self.inputs.select[index].device)
        return carried[0] + mine if carried else mine

    def _routes(
        self, recording: RoutingShape, chosen: list[torch.Tensor], tokens: int, carried: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """The experts the stages before chose for each token (-1 in the layers they do not hold), with this stage's
        layers' columns filled in."""
        if carried:
            routes = carried[0].clone()
        else:
            shape = (tokens, recording.layers, recording.top_k)
            routes = torch.full(shape, -1, dtype=ROUTE_DTYPE, device=self.inputs.select[0].device)
        if chosen:
            routes[:, self.moe_layers] = torch.stack([layer.detach().to(ROUTE_DTYPE) for layer in chosen], dim=1)
        return routes


def split_stage(model: nn.Module, stage: int, num_stages: int, inputs: MicroInputs) -> nn.Module:
    """A copy of ``model`` holding stage ``stage`` of ``num_stages``: its layers, the embedding if first, the final
    norm and the head if last; its ``forward`` is ``StageForward``'s. Parameter names stay the unsplit model's."""
    part = copy.deepcopy(model)
    use_packed_attention(part)
    stack, layers = _parent_of_layers(part)
    kept = stage_layers(len(layers), num_stages)[stage]
    moe_before = sum(bool(experts_modules(layers[index])) for index in range(kept.start))
    moe_layers = slice(moe_before, moe_before + sum(bool(experts_modules(layers[index])) for index in kept))
    for index in range(len(layers)):
        if index not in kept:
            layers[index] = AbsentLayer()
    first, last = stage == 0, stage == num_stages - 1
    head_parent, head_attr = submodule_named(part, head_name(part))
    head = getattr(head_parent, head_attr)
    if not first:
        stack.embed_tokens = None
    if not last:
        stack.norm = nn.Identity()
        setattr(head_parent, head_attr, nn.Identity())
    # an instance attribute: FSDP2 and the schedule call the module (its hooks run), which calls this
    part.forward = StageForward(stack, head if last else None, first, inputs, moe_layers, routers(part))
    return part


def schedule_loss(
    loss: LossOfOutputs, balance: LossOfOutputs | None, given: int, sp_group: dist.ProcessGroup | None
) -> Callable[[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor]:
    """The schedule's loss of the last stage's output for a micro-batch (its index the target): ``loss`` of the
    ``given`` ones, plus ``balance`` of the routing statistics (summed over the slices under Ulysses); zero, with a
    gradient for everything sent, for the empty ones that make up the count."""

    def loss_fn(output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        index = int(target.reshape(-1)[0])
        statistics = None
        if balance is not None:
            output, statistics = output
        if index >= given:
            zero = output.sum() * 0.0
            return zero if statistics is None else zero + statistics.sum() * 0.0
        value = loss(index, output)
        if statistics is not None and sp_size(sp_group) > 1:  # every slice's, the whole micro-batch's
            statistics = sum_over(statistics, sp_group)
        return value if statistics is None else value + balance(index, statistics)

    return loss_fn
