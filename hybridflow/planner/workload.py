"""What one RL step asks of each model: its shape, and the batch every stage runs on.

A run's config gives both (`workload_from_config`: the models' Hugging Face configs, the batch sizes and
lengths, which roles the algorithm needs); paper-scale studies use the Llama shapes of `PAPER_MODELS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridflow.controller import Role
from hybridflow.models.split_sizes import expert_count, indivisible_sizes, shares_heads
from hybridflow.trainer.setup.modes import training_mode


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool
    experts: int = 0  # a mixture of experts: each layer's experts, each an MLP of width ffn (0: one dense MLP)
    experts_per_token: int = 0  # the experts each token runs through

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def _layers_with(self, mlps: int) -> int:
        """The decoder layers' weights with ``mlps`` MLPs of width ffn each (and a mixture's router)."""
        attention = (
            self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        )
        router = self.experts * self.hidden
        return self.layers * (attention + 3 * self.hidden * self.ffn * mlps + router + 2 * self.hidden)

    @property
    def layer_params(self) -> int:
        """Weights of the decoder layers (every expert of a mixture): what tensor parallelism splits."""
        return self._layers_with(max(self.experts, 1))

    @property
    def active_layer_params(self) -> int:
        """The decoder weights a token is multiplied by: a mixture's k experts of E."""
        return self._layers_with(self.experts_per_token if self.experts else 1)

    @property
    def expert_params(self) -> int:
        """The experts' weights (0 for a dense model): what expert parallelism splits."""
        return self.layers * self.experts * 3 * self.hidden * self.ffn

    def read_params(self, tokens: int) -> int:
        """The decoder weights a forward of ``tokens`` tokens reads: a mixture's experts that at most tokens x k
        choices can reach (all of them, once they are as many as the experts)."""
        if not self.experts:
            return self.layer_params
        reached = min(self.experts, tokens * self.experts_per_token)
        return self.layer_params - self.expert_params + self.expert_params * reached // self.experts

    @property
    def embedding_params(self) -> int:
        """Embeddings and LM head (kept whole on every tensor-parallel rank)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        return self.layer_params + self.embedding_params

    def adapter_params(self, rank: int, targets: tuple[str, ...] = ()) -> int:
        """LoRA's trained weights at ``rank``: r x (inputs + outputs) of each adapted projection of every layer
        (``targets``: their names; empty: every linear layer of the decoder)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sizes = {
            "q_proj": self.hidden + q,
            "k_proj": self.hidden + kv,
            "v_proj": self.hidden + kv,
            "o_proj": q + self.hidden,
            "gate_proj": self.hidden + self.ffn,
            "up_proj": self.hidden + self.ffn,
            "down_proj": self.ffn + self.hidden,
        }
        chosen = targets or tuple(sizes)
        return self.layers * rank * sum(sizes[name] for name in chosen if name in sizes)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def splits_over(self, t: int) -> bool:
        """Whole query and key/value heads on each of t ranks, and equal MLP slices or, a mixture's, an equal share
        of whole experts (models/split_sizes.py): training's split and the native engine's generation groups."""
        sizes = dict(heads=self.heads, kv_heads=self.kv_heads, intermediate_size=self.ffn, experts=self.experts)
        return not indivisible_sizes(t, **sizes)

    def expert_splits(self, dp: int) -> list[int]:
        """The expert-parallel sizes over ``dp`` data-parallel ranks: those dividing both them and the experts."""
        return [ep for ep in range(2, dp + 1) if dp % ep == 0 and self.experts % ep == 0] if self.experts else []

    def shares_heads(self, sp: int) -> bool:
        """Whether each of sp Ulysses ranks attends with at least one query head (models/split_sizes.py)."""
        return shares_heads(sp, heads=self.heads)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> ModelShape:
    return ModelShape(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=32000,
        tied_embeddings=False,
    )  # fmt: skip


# the paper's model sizes (Llama-2 7B / 13B / 70B, Code Llama 34B)
PAPER_MODELS = {
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 32, 11008),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 40, 13824),
    "llama-34b": _llama("llama-34b", 48, 8192, 64, 8, 22016),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 8, 28672),
}


def shape_from_hf(config, name: str) -> ModelShape:
    """The shape of a Hugging Face Llama-family config, or of a mixture of experts on its layers (Mixtral, OLMoE,
    Qwen3-MoE: whose experts' width is ``moe_intermediate_size``)."""
    experts = expert_count(config)
    width = (getattr(config, "moe_intermediate_size", None) if experts else None) or config.intermediate_size
    return ModelShape(
        name=name,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        ffn=width,
        vocab=config.vocab_size,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        experts=experts,
        experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
    )


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One step: ``prompts`` x ``n`` samples of ``prompt_length`` + ``response_length`` tokens."""

    models: dict[
        Role, ModelShape
    ]  # the roles the run needs (the actor generates and trains, or a rollout role generates)
    prompts: int
    n: int
    prompt_length: int
    response_length: int
    actor_epochs: int = 1
    critic_epochs: int = 1
    micro_batch: int = 8  # samples per forward/backward on one device (activation memory)
    optimizer_steps: int = 1  # per update epoch (train batch / mini-batch): a pipeline runs one schedule per step
    critic_micro_batch: int = 0  # the critic's micro_batch (0: the actor's)
    critic_optimizer_steps: int = 0  # the critic's optimizer_steps (0: the actor's)
    gradient_checkpointing: bool = False  # keep only each layer's input for the backward
    max_num_seqs: int = 256  # most sequences a generation group decodes at once (its KV cache's slots)
    # LoRA: the trained weights of each role that trains adapters (the rest of its model is frozen)
    adapters: dict[Role, int] = dataclasses.field(default_factory=dict)

    @property
    def rollout_apart(self) -> bool:
        """Whether a rollout role generates on devices of its own, overlapping the actor's training (one step
        off policy), instead of the actor switching between the two."""
        return Role.Rollout in self.models

    def in_mode(self, mode: str) -> Workload:
        """The same step under ``trainer.async_training.mode`` ``mode``: sync (the hybrid actor generates) or
        one_step_off (a rollout role with the policy's shape generates)."""
        models = {role: shape for role, shape in self.models.items() if role is not Role.Rollout}
        if training_mode(mode).rollout_apart:
            models[Role.Rollout] = models[Role.ActorRollout]
        return dataclasses.replace(self, models=models)

    def for_role(self, role: Role) -> Workload:
        """The step as ``role`` runs it: with its own micro-batch and optimizer steps (the critic's section has
        them; every other role's passes are the actor's)."""
        if role is not Role.Critic:
            return self
        return dataclasses.replace(
            self,
            micro_batch=self.critic_micro_batch or self.micro_batch,
            optimizer_steps=self.critic_optimizer_steps or self.optimizer_steps,
        )

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    @property
    def tokens(self) -> int:
        return self.samples * (self.prompt_length + self.response_length)


def workload_from_config(config) -> Workload:
    """The workload of a ``HybridFlowConfig``: its needed roles' model shapes (read from their configs; nothing
    is built or loaded) and its batch."""
    from hybridflow.algorithms import get_adv_estimator
    from hybridflow.models import model_config
    from hybridflow.trainer.setup.role_parts import ROLE_PARTS
    from hybridflow.trainer.setup.roles import needed_roles
    from hybridflow.trainer.setup.run_plan import RunPaths

    # the roles and their model directories, not the config's placement: the planner chooses its own
    arr = config.actor_rollout_ref
    roles = tuple(needed_roles(config, get_adv_estimator(config.algorithm.adv_estimator)))
    paths = RunPaths.resolve(config, roles)
    models = {}
    for role in roles:  # as the config names it (for the plan's printout), and its directory (its part's)
        name, directory = ROLE_PARTS[role].model(config, paths)
        models[role] = shape_from_hf(model_config(directory), str(name))
    adapters = {}
    for role, lora in ((Role.ActorRollout, arr.model.lora), (Role.Critic, config.critic.model.lora)):
        if role in models and lora.enabled:
            targets = () if lora.target_modules == ["all-linear"] else tuple(lora.target_modules)
            adapters[role] = models[role].adapter_params(lora.rank, targets)
    return Workload(
        models=models,
        prompts=config.data.train_batch_size,
        n=arr.rollout.n,
        prompt_length=config.data.max_prompt_length,
        response_length=arr.rollout.response_length,
        actor_epochs=arr.actor.ppo_epochs,
        critic_epochs=config.critic.ppo_epochs,
        micro_batch=arr.actor.ppo_micro_batch_size_per_gpu,
        optimizer_steps=max(config.data.train_batch_size // arr.actor.ppo_mini_batch_size, 1),
        critic_micro_batch=config.critic.ppo_micro_batch_size_per_gpu,
        critic_optimizer_steps=max(config.data.train_batch_size // config.critic.ppo_mini_batch_size, 1),
        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
        max_num_seqs=arr.rollout.native.max_num_seqs,
        adapters=adapters,
    )
