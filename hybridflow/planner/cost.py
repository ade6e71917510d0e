"""The cost model: seconds of each stage and bytes of memory per device, for one model in one layout.

A layout is the one the hybrid actor runs (hybrid_engine/layout_shape.py's ``LayoutShape``): dp x sp x pp x t
ranks, rows split over dp, each micro-batch's tokens over sp (Ulysses), the decoder layers into pp stages (torch's
1F1B schedule), each layer over t, FSDP over dp x sp; the actor generates in groups of pg x tg: pg generation stages
(pg dividing pp; pg = 1: every rank with every layer), each layer over tg.

Kinds of work (per device, one step):
- training and scoring passes are compute-bound: (2 forward, 6 forward + backward) x the weights a rank
  multiplies (1/t of the decoder, the whole LM head) x its tokens, plus causal attention, at
  ``flops x train_efficiency``; tensor parallelism adds 2 (forward) or 4 (forward + backward)
  all-reduces of the activations per layer per micro-batch, and Ulysses 4 (forward) or 8 all-to-alls of a rank's
  slice of them (query, key, value in, the attention's output back; the key and value counted at the query's size);
  FSDP's parameter gathers overlap compute (the pass takes the longer of the two);
- pipeline stages (pp > 1): a rank runs its stage's layers/pp layers (the last stage also the LM head), stretched
  by 1F1B's bubble (``pipeline_bubble``: p - 1 idle slots of m + p - 1), plus each micro-batch's activations sent
  over the p - 1 stage boundaries (and their gradients back in training);
- generation is bound by reading the weights and KV cache once per decode step (``memory_bandwidth x
  decode_efficiency``) or by compute, whichever is slower, plus 2 all-reduces per layer per step
  when tg > 1; prefill is compute; generation stages (pg > 1) compute one after another (rollout/native/stages.py),
  so a group of pg x tg ranks takes a tg group's time per step, plus the hidden states sent over the pg - 1
  boundaries and the last stage's broadcast, and there are pg times fewer groups;
- the actor's switch moves the 3D-HybridEngine's bytes (hybrid_engine/regroup.py) over the link; with stages, a rank
  also receives the generation shards of the other stages that make its generation stage (all of them at pg = 1)
  and the embeddings from the stages holding them;
- every forward call of a layer costs a fixed ``layer_overhead`` besides (``decode_layer_overhead`` in the
  generation engine): kernel dispatch, what dominates small models and small batches on a CPU.

Memory per device: fp32 masters, gradients and Adam's two moments (16 bytes per weight) for trained
models (with LoRA: 16 bytes per adapter weight, the frozen base in bf16), fp32 weights for scored ones,
all sharded over every rank of the model (FSDP over dp x sp, stages over pp, tensor parallelism over t); the actor's
bf16 generation copy (1/(pg x tg) of the decoder, whole embeddings); and the largest transient: activations of a
micro-batch (34 bytes x hidden per token per layer, bf16, Korthikanti et al. 2022, over t; with gradient
checkpointing each layer's bf16 input and one layer's activations) and its fp32 logits, all over sp (a rank holds
its slice of the tokens), or the KV cache of the rank's generation group. A training stage holds the activations of
its layers/pp layers for up to p micro-batches in flight (1F1B's first stage).
"""

from __future__ import annotations

from math import ceil

from hybridflow.controller import Role
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.regroup import predicted_switch_bytes
from hybridflow.hybrid_engine.transfer_plan import predicted_transfer_bytes
from hybridflow.planner.cluster import ClusterSpec
from hybridflow.planner.workload import ModelShape, Workload
from hybridflow.trainer.setup.role_parts import ROLE_PARTS

TRAINED = (Role.ActorRollout, Role.Critic)
UPDATES = ("update_actor", "update_critic")


def phases() -> tuple[tuple[str, ...], ...]:
    """The dataflow's phases: stages of one phase on different device sets run at the same time. Generation; then
    the old log-probs with every role's scoring pass (the reference's, the values, the reward model's, the
    teacher's: each role's part names its stages, trainer/setup/role_parts.py); then the updates."""
    scoring = [
        stage for part in ROLE_PARTS.values() for stage in part.stages if stage not in ("gen", "weight_transfer")
    ]
    return (("gen",), tuple(dict.fromkeys(stage for stage in scoring if stage not in UPDATES)), UPDATES)


def _collective(cluster: ClusterSpec, size: int, nbytes: float) -> float:
    """One all-reduce (ring) of ``nbytes`` among ``size`` devices."""
    if size == 1:
        return 0.0
    return cluster.collective_latency + nbytes * 2 * (size - 1) / size / cluster.link_bandwidth(size)


def _all_to_all(cluster: ClusterSpec, size: int, nbytes: float) -> float:
    """One all-to-all among ``size`` devices, each holding ``nbytes`` and keeping 1/size of them."""
    if size == 1:
        return 0.0
    return cluster.collective_latency + nbytes * (size - 1) / size / cluster.link_bandwidth(size)


def pipeline_bubble(p: int, m: int) -> float:
    """The idle fraction of a 1F1B schedule of ``m`` micro-batches over ``p`` stages, (p - 1) / (m + p - 1): each
    stage waits p - 1 micro-batch slots while the pipeline fills and drains (Narayanan et al. 2021), so a pass takes
    (m + p - 1) / m times its stage's work."""
    return (p - 1) / (m + p - 1)


def schedule_micro_batches(layout: LayoutShape, workload: Workload, *, backward: bool) -> int:
    """The micro-batches one pipeline schedule runs: an optimizer step's on a rank (training: its rows of one of the
    ``optimizer_steps``, in micro-batches of ``micro_batch``), or the whole pass's (scoring)."""
    steps = workload.optimizer_steps if backward else 1
    return ceil(ceil(workload.samples / (steps * layout.dp)) / workload.micro_batch)


def stages_filled(role: Role, layout: LayoutShape, workload: Workload) -> bool:
    """Whether the run plan accepts ``role``'s pipeline stages (trainer/setup/run_plan.py): every schedule has a
    micro-batch for each of the pp stages (the role's own micro-batches and optimizer steps)."""
    if layout.pp == 1:
        return True
    trained = role in TRAINED
    return schedule_micro_batches(layout, workload.for_role(role), backward=trained) >= layout.pp


def stage_traffic_seconds(
    cluster: ClusterSpec, layout: LayoutShape, *, micro_batches: int, activation_bytes: float, backward: bool
) -> float:
    """Point-to-point sends between pipeline stages: each micro-batch's activations over the pp - 1 boundaries, and
    their gradients back in training, among the pp x t ranks of a pipeline."""
    if layout.pp == 1:
        return 0.0
    send = cluster.collective_latency + activation_bytes / cluster.link_bandwidth(layout.pp * layout.t)
    return micro_batches * (layout.pp - 1) * (2 if backward else 1) * send


def pass_seconds(
    shape: ModelShape,
    layout: LayoutShape,
    workload: Workload,
    cluster: ClusterSpec,
    *,
    backward: bool,
    epochs: int = 1,
    frozen_base: bool = False,
) -> float:
    """A scoring pass (backward=False) or ``epochs`` training passes over the step's samples (``frozen_base``:
    LoRA's, whose backward computes the activations' gradients but no weight gradients of the base). With pp stages
    the slowest (last) stage's work, its layers/pp layers and the LM head, is stretched by the pipeline's bubble."""
    rows = ceil(workload.samples / layout.dp)
    length = workload.prompt_length + workload.response_length
    factor = 6 if backward else 2
    if backward and frozen_base:
        factor = 4
    stage_layers = shape.layers / layout.pp  # decoder layers a rank runs
    weights = shape.active_layer_params / (layout.t * layout.pp) + shape.vocab * shape.hidden
    attention = 2 * stage_layers * shape.hidden * length / layout.t  # per token: QK^T and AV over half the context
    rate = cluster.flops * cluster.train_efficiency
    compute = factor * rows * length * (weights + attention) / layout.sp / rate  # a rank runs 1/sp of the tokens
    shards = layout.fsdp
    gathered = shape.params - (shape.expert_params if layout.ep > 1 else 0)  # split experts stay where they are
    gather = 2 * gathered / (layout.t * layout.pp) * (shards - 1) / shards / cluster.link_bandwidth(layout.world)
    micro_batches = ceil(rows / workload.micro_batch)
    per_layer = 4 if backward else 2
    activation = min(rows, workload.micro_batch) * length * shape.hidden * 2
    tp = micro_batches * stage_layers * per_layer * _collective(cluster, layout.t, activation)
    sp = micro_batches * stage_layers * 2 * per_layer * _all_to_all(cluster, layout.sp, activation / layout.sp)
    ep = micro_batches * _expert_exchange_seconds(shape, layout, cluster, activation, backward)
    overhead = micro_batches * stage_layers * cluster.layer_overhead * (3 if backward else 1)
    stage = max(compute, gather * (3 if backward else 1)) + tp + sp + ep + overhead
    idle = pipeline_bubble(layout.pp, schedule_micro_batches(layout, workload, backward=backward))
    traffic = stage_traffic_seconds(
        cluster, layout, micro_batches=micro_batches, activation_bytes=activation, backward=backward
    )
    return epochs * (stage / (1 - idle) + traffic)


def _expert_exchange_seconds(
    shape: ModelShape, layout: LayoutShape, cluster: ClusterSpec, activation: float, backward: bool
) -> float:
    """Expert parallelism's traffic for one micro-batch: in each MoE layer the tokens' k copies go to their experts'
    ranks and back (two all-to-alls; the backward two more), and in training each layer's expert gradients are summed
    over the dp / ep replicas of its experts (fp32)."""
    if layout.ep == 1:
        return 0.0
    exchanges = (
        (4 if backward else 2) * shape.layers * _all_to_all(cluster, layout.ep, activation * shape.experts_per_token)
    )
    replicas = layout.dp // layout.ep
    gradients = _collective(cluster, replicas, 4 * shape.expert_params / layout.ep) if backward else 0.0
    return exchanges + gradients


def generation_seconds(shape: ModelShape, layout: LayoutShape, workload: Workload, cluster: ClusterSpec) -> float:
    """Prefill and decode of the step's samples, the generation groups working at once, each in waves of
    at most ``max_num_seqs`` sequences."""
    groups = layout.world // layout.generation_ranks_per_group
    waves = ceil(ceil(workload.samples / groups) / workload.max_num_seqs)
    batch = ceil(workload.samples / groups / waves)
    weights = shape.active_layer_params / layout.tg + shape.vocab * shape.hidden  # multiplied per token on a rank
    compute_rate = cluster.flops * cluster.train_efficiency
    prefill = 2 * weights * batch * workload.prompt_length / compute_rate
    context = workload.prompt_length + workload.response_length / 2  # the mean over decode steps
    read_weights = shape.read_params(batch) / layout.tg + shape.vocab * shape.hidden  # a mixture: the experts reached
    read = 2 * read_weights + batch * context * shape.kv_bytes_per_token() / layout.tg
    memory_bound = read / (cluster.memory_bandwidth * cluster.decode_efficiency)
    compute_bound = 2 * weights * batch / compute_rate
    tp = 2 * shape.layers * _collective(cluster, layout.tg, batch * shape.hidden * 2)
    if layout.pg > 1:  # the hidden states over the pg - 1 boundaries, then the last stage's to every rank (one more)
        hidden = batch * shape.hidden * 2
        tp += layout.pg * (cluster.collective_latency + hidden / cluster.link_bandwidth(layout.pg))
    overhead = shape.layers * cluster.decode_layer_overhead  # per forward call: the prefill and each decode step
    prefill += overhead
    tp += overhead
    return waves * (prefill + workload.response_length * (max(memory_bound, compute_bound) + tp))


def switch_bytes_received(shape: ModelShape, layout: LayoutShape) -> float:
    """Bytes a rank receives in the actor's switch to generation (bf16): the regrouped switch of its own stage's share
    of the weights (hybrid_engine/regroup.py), and with pp stages the generation shards (1/tg of each split weight)
    of the pp / pg - 1 other stages that make its generation stage, from their pp ranks (pg = 1: every other stage),
    and the other stages' embeddings whole."""
    split, whole = 2 * shape.layer_params, 2 * shape.embedding_params
    experts = 2 * shape.expert_params if layout.ep > 1 else 0  # gathered over the ep ranks that split them
    own_stage = predicted_switch_bytes(
        (split - experts) / layout.pp, whole / layout.pp, dp=layout.fsdp, t=layout.t, tg=layout.tg, method="hybridflow"
    )
    other_stages = (layout.stage_micro_dp - 1) / layout.pp * split / layout.tg + (layout.pp - 1) / layout.pp * whole
    return own_stage + experts * (layout.ep - 1) / layout.ep + other_stages


def switch_seconds(shape: ModelShape, layout: LayoutShape, cluster: ClusterSpec) -> float:
    """The actor's switch to generation: its bytes (``switch_bytes_received``) over the link."""
    return switch_bytes_received(shape, layout) / cluster.link_bandwidth(layout.world)


def transfer_seconds(shape: ModelShape, layout: LayoutShape, cluster: ClusterSpec) -> float:
    """One step off: the new weights to a rollout rank of ``layout`` from the actor's devices (bf16, its
    generation shard: hybrid_engine/transfer_plan.py), over the link between the two sets of devices."""
    received = predicted_transfer_bytes(2 * shape.layer_params, 2 * shape.embedding_params, layout.tg)
    return received / cluster.link_bandwidth(cluster.devices)


def update_seconds(
    role: Role, shape: ModelShape, layout: LayoutShape, workload: Workload, cluster: ClusterSpec, *, epochs: int
) -> float:
    """``role``'s update: ``epochs`` training passes, with a frozen base where it trains LoRA adapters."""
    frozen = role in workload.adapters
    return pass_seconds(shape, layout, workload, cluster, backward=True, epochs=epochs, frozen_base=frozen)


def stage_seconds(role: Role, shape: ModelShape, layout: LayoutShape, workload: Workload, cluster: ClusterSpec) -> dict:
    """Seconds of each of ``role``'s stages (its part's) in ``layout``, with its own micro-batches."""
    workload = workload.for_role(role)
    if role is Role.ActorRollout:
        seconds = {
            "old_log_prob": pass_seconds(shape, layout, workload, cluster, backward=False),
            "update_actor": update_seconds(role, shape, layout, workload, cluster, epochs=workload.actor_epochs),
        }
        if not workload.rollout_apart:
            seconds["gen"] = switch_seconds(shape, layout, cluster) + generation_seconds(
                shape, layout, workload, cluster
            )
        return seconds
    if role is Role.Rollout:
        return {
            "gen": generation_seconds(shape, layout, workload, cluster),
            "weight_transfer": transfer_seconds(shape, layout, cluster),
        }
    if role is Role.Critic:
        return {
            "values": pass_seconds(shape, layout, workload, cluster, backward=False),
            "update_critic": update_seconds(role, shape, layout, workload, cluster, epochs=workload.critic_epochs),
        }
    stage = ROLE_PARTS[role].stages[0]  # a frozen model's scoring pass
    return {stage: pass_seconds(shape, layout, workload, cluster, backward=False)}


def memory_bytes(role: Role, shape: ModelShape, layout: LayoutShape, workload: Workload) -> tuple[float, float]:
    """(held all the time, largest transient) bytes per device of ``role``'s model in ``layout``."""
    workload = workload.for_role(role)
    if role is Role.Rollout:  # only the generation weights (1/tg) and the KV cache
        return _generation_memory(shape, layout, workload)
    shard = layout.world
    static = (16 if role in TRAINED else 4) * shape.params / shard
    if layout.ep > 1:  # split experts: 1/ep of them on each rank, replicated over the dp / ep replicas
        experts = shape.expert_params
        static = (16 if role in TRAINED else 4) * ((shape.params - experts) / shard + experts / layout.ep)
    if role in workload.adapters:  # LoRA: no gradients, optimizer state or fp32 master for the frozen base
        static = (2 * shape.params + 16 * workload.adapters[role]) / shard
    length = workload.prompt_length + workload.response_length
    micro = min(workload.micro_batch, ceil(workload.samples / layout.dp))
    tokens = micro * length / layout.sp  # a rank's slice of the micro-batch's tokens
    logits = 4 * tokens * shape.vocab
    layer_activations = 34 * tokens * shape.hidden / layout.t
    stage_layers = shape.layers / layout.pp
    in_flight = min(layout.pp, schedule_micro_batches(layout, workload, backward=True))  # 1F1B's first stage
    if role in TRAINED and workload.gradient_checkpointing:  # layer inputs, and one layer recomputed at a time
        transient = in_flight * 2 * tokens * shape.hidden * stage_layers + layer_activations + logits
    elif role in TRAINED:  # every layer's activations are kept for the backward
        transient = in_flight * layer_activations * stage_layers + logits
    else:  # a forward keeps about one layer's
        transient = 4 * tokens * shape.hidden + logits
    if role is Role.ActorRollout and not workload.rollout_apart:  # the hybrid actor also holds the generator
        copy, kv_cache = _generation_memory(shape, layout, workload)
        static, transient = static + copy, max(transient, kv_cache)
    return static, transient


def _generation_memory(shape: ModelShape, layout: LayoutShape, workload: Workload) -> tuple[float, float]:
    """(the generation copy of the weights, the KV cache while generating) bytes per device."""
    ranks = layout.generation_ranks_per_group  # each holds 1/(pg x tg) of the decoder and of its groups' cache
    copy = 2 * (shape.layer_params / ranks + shape.embedding_params)
    groups = layout.world // ranks
    running = min(ceil(workload.samples / groups), workload.max_num_seqs)
    length = workload.prompt_length + workload.response_length
    return copy, running * length * shape.kv_bytes_per_token() / ranks


def layouts_for(role: Role, shape: ModelShape, devices: int, cluster: ClusterSpec) -> list[LayoutShape]:
    """Every layout of ``role`` on ``devices`` devices: t divides them, splits the heads and stays in a
    node; the actor's tg divides t; Ulysses over sp ranks, t x sp in a node, each rank with at least one head;
    pipeline stages over pp ranks beside each of those (pp dividing the layers, t x sp x pp the devices, across
    nodes too), the actor generating in pg stages for every pg dividing pp;
    the reward model is data-parallel only. A mixture of experts is not put in stages here: it splits its experts
    between t ranks (whole experts on each, as generation groups of tg do), over ep of its dp ranks where it trains,
    or runs Ulysses (ep = 1: the three do not combine)."""
    in_node = [size for size in range(1, min(devices, cluster.devices_per_node) + 1) if devices % size == 0]
    if role is Role.RewardModel:
        return [LayoutShape.over(devices)]
    if role is Role.Rollout:  # replicas of tg ranks (a mixture's experts split over them, each whole on one)
        return [LayoutShape.over(devices, tg, tg) for tg in in_node if shape.splits_over(tg)]
    sizes = [t for t in in_node if shape.splits_over(t)]
    tgs = {t: [tg for tg in range(1, t + 1) if t % tg == 0] if role is Role.ActorRollout else [1] for t in sizes}
    if shape.experts:  # its experts over ep of the dp ranks or t ranks, or Ulysses (none of them combine)
        splits = [1, *shape.expert_splits(devices)] if role in TRAINED else [1]
        ulysses = [sp for sp in in_node if sp > 1 and shape.shares_heads(sp)]
        return (
            [LayoutShape(dp=devices, t=1, tg=1, ep=ep) for ep in splits]
            + [LayoutShape(dp=devices // t, t=t, tg=tg) for t in sizes if t > 1 for tg in tgs[t]]
            + [LayoutShape(dp=devices // sp, t=1, tg=1, sp=sp) for sp in ulysses]
        )
    shapes = [
        (t, sp, 1) for t in sizes for sp in in_node if t * sp in in_node and shape.shares_heads(sp * t)
    ]  # (t, 1) for every t in sizes, and the Ulysses sizes beside each
    shapes += [
        (t, sp, pp)
        for t, sp, _ in list(shapes)
        for pp in range(2, devices // (t * sp) + 1)
        if devices % (t * sp * pp) == 0 and shape.layers % pp == 0
    ]  # stages of equal size beside each (t, sp)
    return [
        LayoutShape(dp=devices // (t * sp * pp), t=t, tg=tg, sp=sp, pp=pp, pg=pg)
        for t, sp, pp in shapes
        for tg in tgs[t]
        for pg in (range(1, pp + 1) if role is Role.ActorRollout else (1,))
        if pp % pg == 0
    ]
