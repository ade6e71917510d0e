"""The rollout role: generation on a pool of its own, for asynchronous training (trainer/setup/modes.py).

Its ranks hold the rollout engine (native or vLLM, with the agent loops of a multi-turn run) in generation
groups of tg, and nothing of training; ``generate_sequences`` behaves as the hybrid actor's does (the same
dispatch, the same seeds for as many generation groups). After each update the actor's pool sends the new
weights straight to these ranks, each receiving only its own generation shard (hybrid_engine/pool_transfer.py):
``receive_weights`` on this side, ``ActorWorker.send_weights`` on the other, both in flight at once.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from hybridflow.batch_keys import INTERRUPT_KEY, METRICS, PREFIX_LENGTH
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.controller.decorator import mesh_compute_proto
from hybridflow.hybrid_engine.interrupt import InterruptPoller
from hybridflow.hybrid_engine.layout_shape import LayoutShape
from hybridflow.hybrid_engine.pool_transfer import TransferReport, receive_weights
from hybridflow.hybrid_engine.transfer_setup import TransferSetup
from hybridflow.models import load_tokenizer, parse_dtype
from hybridflow.protocol import DataProto
from hybridflow.workers.config import ActorRolloutRefConfig
from hybridflow.workers.generation import build_generator, call_sampling

GENERATE_MESH = "rollout_generate"  # (generation groups, tg): generate_sequences splits prompts over the groups


class RolloutWorker(Worker):
    """model_path: the policy's model directory (the weights before the first transfer); layout: this pool's
    ranks in generation groups of tg (dp = the groups); tool_config, default_agent: the multi-turn files."""

    def __init__(
        self,
        *,
        config: ActorRolloutRefConfig,
        model_path: str,
        layout: LayoutShape,
        tool_config: str,
        default_agent: str,
    ):
        super().__init__()
        self.config = config
        self.layout = layout
        self.tokenizer = load_tokenizer(model_path)
        mesh = DeviceMesh(self.device.type, layout.generation_ranks(), mesh_dim_names=("dp", "tp"))
        self.generation_coord = self.register_dispatch_mesh(GENERATE_MESH, mesh)
        self.dtype = parse_dtype(config.rollout.dtype, self.device)
        self.rollout = build_generator(
            model_path,
            self.tokenizer,
            config.rollout,
            dtype=self.dtype,
            device=self.device,
            group=mesh["tp"].get_group() if layout.tg > 1 else None,
            tool_config=tool_config,
            default_agent=default_agent,
        )
        self.weights_version = 0  # the actor's step whose weights the engine holds

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_transfer(self, setup: TransferSetup) -> None:
        """Join the group spanning both pools, and plan this rank's part of every transfer."""
        self.transfer_plan = setup.plan(self.dtype)
        self.adapter_plan = setup.adapter_plan(self.dtype)
        self.adapter_scaling = setup.adapter_scaling
        self.base_received = False  # a LoRA policy's base comes once, with the first transfer
        self.transfer = setup.join(actor_side=False, rank=self.rank, device=self.device)
        self.transfer_timeout = setup.timeout_s

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int) -> TransferReport:
        """Take the actor's weights of step ``version`` into the engine as they arrive (this rank's generation
        shard only), while the actor's ranks send them: all of them, or a LoRA policy's adapters (its base
        too the first time)."""
        report = TransferReport()

        def receive(plan):
            return receive_weights(
                plan, self.transfer, report, dtype=self.dtype, device=self.device, timeout=self.transfer_timeout
            )

        if self.adapter_plan is None:
            self.rollout.load_weights(receive(self.transfer_plan))
        else:
            if not self.base_received:
                self.rollout.load_base_weights(receive(self.transfer_plan))
                self.base_received = True
            self.rollout.load_adapters(receive(self.adapter_plan), self.adapter_scaling)
        self.weights_version = version
        return report

    @register(dispatch_mode=mesh_compute_proto(GENERATE_MESH))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses with the weights of step ``weights_version`` (``rollout/weights_version`` in the metrics).
        Every rank of a generation group gets the same prompts; one of them is collected. With partial rollout
        the call stops when the driver sets its ``interrupt_key`` (hybrid_engine/interrupt.py), and continues
        rows that carry a ``prefix_length``."""
        sampling = call_sampling(self.config.rollout, prompts.meta_info, self.generation_coord)
        key = prompts.meta_info.get(INTERRUPT_KEY)
        if (
            key is not None or PREFIX_LENGTH in prompts.batch.keys()
        ):  # partial rollout (trainer/asynchronous/rollouter.py)
            should_stop = InterruptPoller(self.transfer.store, key) if key is not None else None
            output = self.rollout.generate_partial(prompts, sampling, should_stop)
        else:
            output = self.rollout.generate_sequences(prompts, sampling)
        output.meta_info[METRICS] = {"rollout/weights_version": float(self.weights_version)}
        return output
