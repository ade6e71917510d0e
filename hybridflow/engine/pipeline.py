"""Pipeline parallelism: a model's decoder layers split into stages over the ranks of a "pp" group, run by torch's own
schedules (torch.distributed.pipelining: 1F1B, interleaved 1F1B) over packed micro-batches.

A stage (pipeline_stages.py) is a copy of the transformers model that keeps its share of the decoder layers (the
others become ``AbsentLayer``, so every parameter keeps the unsplit model's name: checkpoints do not depend on the
layout), the embedding on the first stage, and the final norm and the head on the last. Each rank holds one stage
(1F1B) or ``stages_per_rank`` of them, stage ``rank + k * pp`` (interleaved). Every stage is sharded as the unsplit
model is (tensor parallelism over "tp", FSDP2 over "dp"), so the mesh is (dp, pp, tp); under Ulysses its "dp" holds
the dp x sp ranks, and each stage's sp ranks run their slices of every micro-batch.

Every rank of a pp group holds the same rows. A pass packs each micro-batch (``packing.pack``) on every stage alike,
and pads them all to one length with filler tokens in a row of their own (``pad_packed``): torch's schedules fix the
shapes sent between stages for a whole ``step``. The first stage embeds the token ids; each stage sends its hidden
states (1, N, D) to the next; the last stage gives the head's output at the selected packed positions (those that
predict response tokens), the same values the unsplit ``forward.response_outputs`` gives, to a loss (training:
1F1B's backward follows) or back to the caller (scoring, forward only). Stages and schedule are built for each pass
with their shapes given (no shape inference run), so every pass may have its own lengths and micro-batch count.

Gradients: each micro-batch's loss is its share of the global loss as without stages (``scale_grads`` off); FSDP2
reduces the gradients over "dp" once per pass. A model with tied embeddings holds the embedding on the first stage
and the head on the last: their gradients are summed over the two (``TiedWeights``), so both copies take the same
step and stay equal, as the one tensor of the unsplit model does. The gradient norm sums every stage's squares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from hybridflow.engine.fsdp import full_parameters, gradient_square_sum
from hybridflow.engine.packing import (
    PackedBatch,
    SequenceShards,
    empty_packed,
    pad_packed,
    real_in_slice,
    sequence_slice,
    slice_packed,
)
from hybridflow.engine.pipeline_stages import (
    PIPELINE_DIM,
    LossOfOutputs,
    MicroInputs,
    RoutingShape,
    decoder_layer_index,
    local_stages,
    schedule_loss,
    split_stage,
)
from hybridflow.engine.pipeline_tied import TIED_HEAD, TiedWeights, tied_weights
from hybridflow.engine.sequence_parallel import sp_size
from hybridflow.models.routing import ROUTE_DTYPE, RouteReplay, routers
from hybridflow.models.split_sizes import expert_count


def whole_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``fsdp.full_parameters`` of a model, pipelined or not: every stage's on every rank (a collective)."""
    if not isinstance(model, PipelinedModel):
        yield from full_parameters(model)
        return
    for name, tensor, _ in model.stage_by_stage(lambda stage: full_parameters(stage)):
        yield name, tensor


def held_tensors(
    model: nn.Module, produce: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``produce(model)`` (e.g. lora.py ``policy_parameters``): of a pipelined model, of this rank's stages only, under
    the unsplit names (``PipelinedModel.held_named``)."""
    if isinstance(model, PipelinedModel):
        yield from model.held_named(produce)
    else:
        yield from produce(model)


def pipeline_mesh(device: torch.device, dp: int, pp: int, tp: int) -> DeviceMesh:
    """The (dp, pp, tp) mesh over the process group's ranks, rank = (dp_index * pp + pp_index) * tp + tp_index: the pp
    (and tp) ranks of one dp index hold the same rows."""
    return init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=("dp", PIPELINE_DIM, "tp"))


class PipelinedModel(nn.Module):
    """This rank's stages of a model split into ``num_stages`` over the pp ``group``: one runs torch's 1F1B schedule,
    more the interleaved 1F1B one. ``hidden_size`` and ``activation_dtype``: what stages send each other; ``tied``:
    the embedding and head gradient sum of a model with tied embeddings (None: untied, or neither on this rank);
    ``routing``: a mixture of experts' routing statistics, which stages send each other in a pass with the balancing
    loss (None: the model has no MoE layers)."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        indices: Sequence[int],
        num_stages: int,
        group: dist.ProcessGroup,
        hidden_size: int,
        activation_dtype: torch.dtype,
        inputs: MicroInputs,
        tied: TiedWeights | None = None,
        routing: RoutingShape | None = None,
    ):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.indices = list(indices)
        self.num_stages = num_stages
        self.group = group
        self.hidden_size = hidden_size
        self.activation_dtype = activation_dtype
        self.inputs = inputs
        self.tied = tied
        self.routing = routing  # a mixture's: what its stages carry for the balancing loss (None: no MoE layers)

    @property
    def config(self):
        """The model's config (every stage's)."""
        return self.stages[0].config

    @property
    def peft_config(self) -> dict:
        """A LoRA model's adapter settings (every stage's; {} without LoRA), as peft's model has them."""
        return getattr(self.stages[0], "peft_config", {})

    @property
    def device(self) -> torch.device:
        """Where this rank's stages live."""
        return next(self.parameters()).device

    @property
    def pp_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def last_rank(self) -> int:
        """The global rank holding the last stage."""
        return self.stage_rank(self.num_stages - 1)

    def stage_rank(self, stage: int) -> int:
        """The global rank holding ``stage`` (``local_stages``' placement)."""
        return dist.get_global_rank(self.group, stage % self.pp_size)

    def local_stage(self, stage: int) -> nn.Module | None:
        """This rank's module of ``stage`` (None: another pp rank holds it)."""
        return self.stages[self.indices.index(stage)] if stage in self.indices else None

    @property
    def tied_head_name(self) -> str | None:
        """The name of the head's weight where it is the embedding's (the last stage's copy), else None."""
        return f"{TIED_HEAD}.weight" if self.tied is not None else None

    def _pipeline_stages(self, length: int, training: bool) -> list[PipelineStage]:
        device = self.device
        meta = torch.device("meta")
        hidden = torch.empty(1, length, self.hidden_size, dtype=self.activation_dtype, device=meta)
        hidden.requires_grad_(training)
        carried = ()  # what a mixture's stages carry after the hidden states (pipeline_stages.py ``StageForward``)
        routing, recording = self.inputs.routing, self.inputs.recording
        if routing is not None:  # the routing statistics
            shape = (routing.layers + 2, routing.experts)
            carried = (torch.empty(shape, dtype=torch.float32, device=meta, requires_grad=training),)
        elif recording is not None:  # the experts each token was routed to
            shape = (length, recording.layers, recording.top_k)
            carried = (torch.empty(shape, dtype=ROUTE_DTYPE, device=meta),)
        stages = []
        for module, index in zip(self.stages, self.indices):
            first, last = index == 0, index == self.num_stages - 1
            given = torch.empty(1, length, dtype=torch.long, device=meta) if first else (hidden, *carried)
            output = (
                torch.empty(1, dtype=self.activation_dtype, device=meta, requires_grad=training) if last else hidden
            )
            stages.append(
                PipelineStage(
                    module,
                    index,
                    self.num_stages,
                    device,
                    input_args=given,
                    output_args=(output, *carried) if carried else output,
                    group=self.group,
                )
            )
        return stages

    def micro_batch_count(self, count: int) -> int:
        """The micro-batches a schedule runs for ``count`` of them: at least one per pp rank (1F1B), and a multiple
        of the pp size (interleaved 1F1B runs them in rounds of that size)."""
        count = max(count, self.pp_size)
        if len(self.stages) > 1:  # interleaved
            count = -(-count // self.pp_size) * self.pp_size
        return count

    def run(
        self,
        packed: list[PackedBatch],
        select: list[torch.Tensor],
        loss: LossOfOutputs | None = None,
        routes: list[torch.Tensor] | None = None,
        replay: RouteReplay | None = None,
        balance: LossOfOutputs | None = None,
        record: bool = False,
        sp_group: dist.ProcessGroup | None = None,
    ) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every micro-batch (``packed``, each read at ``select``) through the stages. With ``loss`` (training): loss(i,
        outputs) is micro-batch i's loss on the last stage, backwarded by the schedule; returns None. Without: forward
        only, no gradients; returns each micro-batch's outputs on the rank holding the last stage (None elsewhere).
        Where the schedule needs more micro-batches than given (``micro_batch_count``), empty ones (filler tokens
        only, no outputs, no loss) make up the number. ``routes``: routing replay, each micro-batch's packed tokens'
        recorded experts (N, L, k), each stage replaying its layers' (``replay`` counts). ``balance`` (training a
        mixture): balance(i, statistics) is added to micro-batch i's loss, from the whole model's routing statistics
        of its real tokens (``StageForward``). ``record`` (forward only, a mixture): each micro-batch's outputs come
        with the experts every MoE layer routed each of its packed tokens to, (tokens, L, k). ``sp_group`` (Ulysses):
        every micro-batch padded to one length (packing.py ``sequence_slice``), this rank's stages run its slice of
        the tokens, whose selected positions give the outputs (``select`` still indexes the whole micro-batch), what
        stages send each other is the slice's, the routes recorded are the slice's, and the routing statistics are
        summed over the group before the balancing loss."""
        if balance is not None and (loss is None or self.routing is None):
            raise ValueError("a balancing loss is added to a training pass's loss, of a model with MoE layers")
        if record and (loss is not None or self.routing is None):
            raise ValueError("routes are recorded by a forward-only pass, of a model with MoE layers")
        given = len(packed)
        count, width = self._take(packed, select, routes, replay, sp_group)
        self.inputs.routing = self.routing if balance is not None else None
        self.inputs.recording = self.routing if record else None
        stages = self._pipeline_stages(width, training=loss is not None)
        step_loss = None if loss is None else schedule_loss(loss, balance, given, sp_group)
        if len(stages) > 1:
            schedule = ScheduleInterleaved1F1B(stages, count, loss_fn=step_loss, scale_grads=False)
        else:
            schedule = Schedule1F1B(stages[0], count, loss_fn=step_loss, scale_grads=False)
        ids = torch.cat([p.input_ids for p in self.inputs.packed]) if 0 in self.indices else None
        args = (ids,) if ids is not None else ()
        order = torch.arange(count)
        try:
            if loss is not None:
                schedule.step(*args, micro=order, target=order)
                if self.tied is not None:
                    self.tied.sum_gradients()
                return None
            with torch.no_grad():
                schedule.eval(*args, micro=order)
            last = [s for s in stages if s.is_last]
            return list(last[0].output_chunks)[:given] if last else None
        finally:
            self.inputs.clear()
            # the schedules may leave a stage's weights gathered (interleaved 1F1B under FSDP2): the next pass must
            # gather them anew, after the optimizer step
            for module in self.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _take(
        self,
        packed: list[PackedBatch],
        select: list[torch.Tensor],
        routes: list[torch.Tensor] | None,
        replay: RouteReplay | None,
        sp_group: dist.ProcessGroup | None,
    ) -> tuple[int, int]:
        """Set ``inputs`` to a pass's micro-batches, made up to the schedule's count with empty ones, padded to one
        length and cut to this rank's slice under Ulysses (with their selected positions, real tokens and routes);
        returns the count and the tokens each micro-batch has on this rank."""
        given = len(packed)
        count = self.micro_batch_count(given)
        length, start, width = sequence_slice(packed, sp_group)
        real = [p.input_ids.shape[1] for p in packed] + [0] * (count - given)
        self.inputs.real_tokens = [real_in_slice(r, start, width) for r in real]  # of this rank's slice
        packed = list(packed) + [empty_packed(packed[0])] * (count - given)
        select = list(select) + [select[0].new_zeros(0)] * (count - given)
        self.inputs.packed = [slice_packed(pad_packed(p, length), start, width) for p in packed]
        self.inputs.select = [s[(s >= start) & (s < start + width)] - start for s in select]
        self.inputs.shards = SequenceShards(sp_group, length, length) if sp_size(sp_group) > 1 else None
        if routes is not None:  # the padding that evens the micro-batches routes itself
            pad = lambda r: nn.functional.pad(r, (0, 0, 0, 0, 0, length - r.shape[0]), value=-1)  # noqa: E731
            self.inputs.routes, self.inputs.replay = [pad(r)[start : start + width] for r in routes], replay
        return count, width

    def grad_norm_and_clip(self, max_norm: float) -> float:
        """The gradient norm over every stage (the tied head counted once), after scaling the gradients down to
        ``max_norm`` when above it."""
        duplicate = self.tied.duplicate if self.tied is not None else None
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.parameters():
            if p.grad is not None and p is not duplicate:
                square += gradient_square_sum(p.grad)
        dist.all_reduce(square, group=self.group)
        total = float(square) ** 0.5
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0 and total == total and total != float("inf"):
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        return total

    def stage_by_stage(
        self,
        produce: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]],
        layer_group: dist.ProcessGroup | None = None,
    ) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """(name, tensor, whether it came from another rank) of every stage in order, on every rank of the pp
        group: the rank holding a stage runs ``produce`` on it (a collective within its own dp and tp groups), then
        sends the tensors to its pp peers. A name an earlier stage gave, and a tied head (the last stage's copy of the
        embedding), are left out: the unsplit model has one tensor of each. ``layer_group`` (pp ranks; None: all of
        them): a decoder layer's tensors go to the ranks of the holder's ``layer_group`` only, and the others see
        none of them (generation stages, hybrid_engine/layout_shape.py); the rest still go to every pp rank."""
        seen = {self.tied_head_name}  # every rank sees every name: the same set everywhere
        if layer_group is not None:
            mine = set(dist.get_process_group_ranks(layer_group))
        for stage in range(self.num_stages):
            owner = self.stage_rank(stage)
            local = self.local_stage(stage)
            made = None
            if local is not None:  # a name another stage gave (the rotary embedding's buffers) is not sent again
                made = [(name, tensor) for name, tensor in produce(local) if name not in seen]
            box = [[(name, tuple(t.shape), t.dtype) for name, t in made] if made is not None else None]
            dist.broadcast_object_list(box, src=owner, group=self.group)
            for index, (name, shape, dtype) in enumerate(box[0]):
                group = self.group
                if layer_group is not None and decoder_layer_index(name) is not None:
                    if owner not in mine:
                        seen.add(name)
                        continue
                    group = layer_group
                if made is not None:
                    tensor = made[index][1].contiguous()
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=owner, group=group)
                seen.add(name)
                yield name, tensor, made is None

    def stage_named(
        self, produce: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]], stage: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``produce`` (e.g. lora.py ``policy_parameters``) of this rank's module of ``stage``, under the unsplit
        names, without the last stage's copy of a tied embedding (the unsplit model has one tensor)."""
        for name, tensor in produce(self.local_stage(stage)):
            if name != self.tied_head_name:
                yield name, tensor

    def held_named(
        self, produce: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``stage_named`` of every stage of this rank, in order."""
        for stage in self.indices:
            yield from self.stage_named(produce, stage)

    def share_from_last(self, value):
        """``value`` as the rank holding the last stage has it, on every rank of the pp group (an object)."""
        box = [value]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]


def build_pipelined(
    model: nn.Module,
    mesh: DeviceMesh,
    shard: Callable[[nn.Module], nn.Module],
    *,
    stages_per_rank: int,
    activation_dtype: torch.dtype,
) -> PipelinedModel:
    """This rank's stages of ``model`` on the (dp, pp, tp) ``mesh`` (``stages_per_rank`` of them: above 1, the
    interleaved 1F1B schedule), each sharded by ``shard`` (tensor parallelism and FSDP2 as for the unsplit model)."""
    pp = mesh[PIPELINE_DIM].size()
    num_stages = pp * stages_per_rank
    inputs = MicroInputs([], [])
    indices = local_stages(mesh[PIPELINE_DIM].get_local_rank(), pp, stages_per_rank)
    text_config = model.config.get_text_config()
    gates = routers(model)
    routing = None
    if gates:
        routing = RoutingShape(int(text_config.num_experts_per_tok), len(gates), expert_count(model.config))
    stages = [shard(split_stage(model, index, num_stages, inputs)) for index in indices]
    tie = tied_weights(model, mesh, stages, indices, num_stages)
    return PipelinedModel(
        stages,
        indices,
        num_stages,
        mesh[PIPELINE_DIM].get_group(),
        text_config.hidden_size,
        activation_dtype,
        inputs,
        tie,
        routing,
    )
