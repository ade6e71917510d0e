"""The hybrid actor: trains with FSDP2 and generates in the same process, on the same devices."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine.checkpoint import load_training_state, save_training_state
from hybridflow.engine.fsdp import full_parameters, parse_dtype
from hybridflow.engine.memory import peak_memory_gb
from hybridflow.engine.policy import PolicyEngine
from hybridflow.hybrid_engine import HybridEngine
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.registry import build_rollout
from hybridflow.workers.config import ActorRolloutRefConfig
from hybridflow.workers.sharded_model import build_trainable, samples_per_rank


class ActorRolloutWorker(Worker):
    def __init__(self, config: ActorRolloutRefConfig, total_training_steps: int, seed: int = 0):
        super().__init__()
        self.config = config
        self.seed = seed
        self.tokenizer = load_tokenizer(config.model.path)
        model, optimizer, scheduler = build_trainable(
            load_causal_lm, config.model, config.actor.fsdp, config.actor.optim, self.device, seed, total_training_steps
        )
        self.actor = PolicyEngine(model, optimizer, scheduler, config.actor)
        generator = load_causal_lm(config.model.path, dtype=parse_dtype(config.rollout.dtype)).to(self.device)
        self.rollout = build_rollout(config.rollout.name, generator, self.tokenizer, config.rollout)
        self.hybrid = HybridEngine(
            model, optimizer, self.rollout, self.device, config.actor.param_offload, config.actor.optimizer_offload
        )

    def _sampling(self, meta_info: dict) -> SamplingParams:
        cfg = self.config.rollout
        step = int(meta_info.get("global_step", 0))
        seed = cfg.seed + 100_003 * step + 1_009 * self.rank
        sampling = meta_info.get("sampling", "train")
        if sampling == "greedy":
            return SamplingParams(False, 1.0, 1.0, -1, cfg.response_length, seed)
        source = cfg.val_kwargs if sampling == "validate" else cfg
        return SamplingParams(
            source.do_sample, source.temperature, source.top_p, source.top_k, cfg.response_length, seed
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Switch to generation, generate, switch back (see HybridEngine); the switch metrics in meta_info["metrics"]."""
        return self.hybrid.generate(prompts, self._sampling(prompts.meta_info))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trained weights gathered from the shards (fp32, on CPU) on rank 0; every rank takes part."""
        weights = {name: tensor.detach().cpu().clone() for name, tensor in full_parameters(self.actor.model)}
        return weights if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """The actor's training state under ``directory/actor``, plus its HF config and tokenizer for export."""
        target = Path(directory) / "actor"
        save_training_state(target, self.actor.model, self.actor.optimizer, self.actor.scheduler, self.rank)
        if self.rank == 0:
            self.actor.model.config.save_pretrained(target / "huggingface")
            self.actor.model.generation_config.save_pretrained(target / "huggingface")
            self.tokenizer.save_pretrained(target / "huggingface")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        load_training_state(
            Path(directory) / "actor", self.actor.model, self.actor.optimizer, self.actor.scheduler, self.rank
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        log_probs, entropy = self.actor.compute_log_prob(data, self.config.rollout.temperature, with_entropy=True)
        return DataProto.from_dict(
            {"old_log_probs": log_probs, "entropys": entropy}, meta_info={"perf": self.actor.log_prob_metrics}
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def pre_update_log_probs(self, data: DataProto) -> DataProto:
        """The old log-probs and entropy that the last on-policy ``update_actor`` took from its own
        forward (it ran without ``old_log_probs``), for the rows of ``data`` (that update's batch)."""
        pre_update = self.actor.pre_update
        if not pre_update or len(pre_update["old_log_probs"]) != len(data):
            raise RuntimeError("no on-policy update of this batch ran: call update_actor without old_log_probs first")
        return DataProto.from_dict(dict(pre_update))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        cfg = self.config
        mini_batch = samples_per_rank(
            cfg.actor.ppo_mini_batch_size, cfg.rollout.n, self.world_size, "actor.ppo_mini_batch_size"
        )
        step = int(data.meta_info.get("global_step", 0))
        metrics = self.actor.update_policy(data, mini_batch, cfg.rollout.temperature, seed=self.seed + step)
        metrics["perf/max_memory_gb"] = peak_memory_gb(self.device)  # the step's peak: reset when it generated
        return metrics
