"""Typed configs of the training engine: model, FSDP2, actor, reference, critic (the optimizer's,
``OptimConfig``, is in optim.py beside the code that reads it).

Fields carry no defaults: hybridflow/config/ppo_trainer.yaml writes every default once, and
``hybridflow.trainer.setup.config.default_config()`` gives them as these objects. Each class checks
its own values; checks that need several sections are in ``trainer/setup/check_config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.algorithms import AGG_MODES, KL_TYPES, PolicyLossConfig
from hybridflow.engine.lora import LoraConfig
from hybridflow.engine.optim import OptimConfig
from hybridflow.models.dtypes import DTYPE_CHOICES, DTYPES
from hybridflow.validation import require, require_choice, require_positive_fields

# the sizes of a role's parallel layout, each a count of ranks (so positive)
_PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "ulysses_sequence_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
)


@dataclass(kw_only=True)
class ModelPathConfig:
    path: str  # local Hugging Face directory, or a built-in name (tiny-llama, smollm2-135m-instruct; models/builtin.py)


@dataclass(kw_only=True)
class ModelConfig(ModelPathConfig):
    enable_gradient_checkpointing: bool  # recompute activations in backward to save memory


@dataclass(kw_only=True)
class TrainedModelConfig(ModelConfig):
    """A model that a role trains (the actor's, the critic's)."""

    lora: LoraConfig  # LoRA adapters (peft) instead of training every weight; rank 0: off


@dataclass(kw_only=True)
class FSDPConfig:
    # compute dtype of forward/backward (auto | bf16 | fp32; auto: bf16 where the device has bf16 matmul units, else
    # fp32); master weights stay fp32
    param_dtype: str
    reduce_dtype: str  # dtype of the gradient reduce-scatter across ranks
    # CPU ranks on one host all-gather weights and reduce-scatter gradients through shared memory (/dev/shm) instead of
    # gloo's loopback sockets (2 ranks: bitwise gloo's result); ranks on several hosts, and GPUs, keep the process group
    host_collectives: bool

    def __post_init__(self) -> None:
        require_choice(self.param_dtype, DTYPE_CHOICES, "param_dtype")
        require_choice(self.reduce_dtype, DTYPES, "reduce_dtype")


@dataclass(kw_only=True)
class UpdateConfig:
    """What the actor's and the critic's updates share (engine/update.py reads it): micro-batches, epochs, loss
    aggregation, gradient clipping, the optimizer and FSDP2. Each role adds its own fields; the mini-batch is the
    caller's (the run plan's split of ``ppo_mini_batch_size``, trainer/setup/config.py)."""

    ppo_micro_batch_size_per_gpu: int  # samples per forward/backward on one rank (gradient accumulation)
    ppo_epochs: int  # passes over the batch per training step
    shuffle: bool  # shuffle samples between mini-batches (seeded)
    tensor_model_parallel_size: int  # ranks that split each decoder layer (DTensor; the actor's t); FSDP2 over the rest
    # Ulysses: ranks that hold the same rows and split each micro-batch's tokens (attention by all-to-all over heads);
    # the data-parallel ranks are the rest: world / (this x tensor_model_parallel_size); needs use_remove_padding
    ulysses_sequence_parallel_size: int
    # pipeline parallelism: ranks that split the decoder layers into stages (torch's 1F1B schedules); they hold the same
    # rows; the data-parallel ranks are the rest: world / (this x tensor_model_parallel_size); needs use_remove_padding
    pipeline_model_parallel_size: int
    # stages per pipeline rank: 1 runs the 1F1B schedule, more the interleaved 1F1B one (smaller bubble, more sends)
    virtual_pipeline_model_parallel_size: int
    # mixture of experts: data-parallel ranks that split each MoE layer's experts, tokens sent to them by all-to-all
    # (1: every rank holds every expert); divides the data-parallel ranks and the experts; no tensor, sequence or
    # pipeline split with it
    expert_model_parallel_size: int
    # mixture of experts: weight of the routers' load-balancing loss in the update (null: the model config's
    # router_aux_loss_coef; 0: none)
    router_aux_loss_coef: float | None
    use_remove_padding: bool  # run forward/backward on the packed real tokens only (no compute on padding)
    use_dynamic_bsz: bool  # micro-batches by token count (the *_max_token_len_per_gpu keys) instead of sample count
    ppo_max_token_len_per_gpu: int  # use_dynamic_bsz: most real tokens per forward/backward micro-batch on one rank
    # how the loss averages over tokens and sequences: token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean
    # | seq-mean-token-sum-norm
    loss_agg_mode: str
    grad_clip: float  # max global grad norm; steps with a non-finite norm are skipped
    # FSDP2 in the update: free each layer's gathered weights after its forward and gather them again for its backward
    # and for every micro-batch (true), or gather them once per mini-batch and keep them through its micro-batches
    # (false: one all-gather and cast per mini-batch instead of two per micro-batch, the same numbers; the whole model
    # is held in param_dtype while a mini-batch trains); null: false on CPU, true on a GPU
    reshard_after_forward: bool | None
    optim: OptimConfig  # AdamW and its learning-rate schedule
    fsdp: FSDPConfig  # FSDP2's compute and gradient-reduction dtypes

    def __post_init__(self) -> None:
        require_positive_fields(
            self,
            "ppo_micro_batch_size_per_gpu",
            "ppo_epochs",
            *_PARALLEL_SIZES,
            "ppo_max_token_len_per_gpu",
            "grad_clip",
            "expert_model_parallel_size",
        )
        require_choice(self.loss_agg_mode, AGG_MODES, "loss_agg_mode")
        coefficient = self.router_aux_loss_coef
        require(coefficient is None or coefficient >= 0, "router_aux_loss_coef", f"must be >= 0, got {coefficient}")
        if self.expert_model_parallel_size > 1:
            split = [f"{name}={getattr(self, name)}" for name in _PARALLEL_SIZES[:3] if getattr(self, name) > 1]
            require(
                not split,
                "expert_model_parallel_size",
                f"is {self.expert_model_parallel_size} with {', '.join(split)}: experts split over data-parallel ranks "
                "alone (tensor, sequence and pipeline splits with experts are not built)",
                "set expert_model_parallel_size=1 or the other sizes to 1",
            )


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass(kw_only=True)
class RouterReplayConfig:
    # mixture of experts, routing replay (models/routing.py): disabled | R2: the actor's update routes each token
    # through the experts its old-log-prob pass chose (needs that pass: more than one optimizer step on a batch, or
    # reuse_update_log_probs=false) | R3: the rollout (rollout.name=native or hf) records each token's experts and the
    # actor's log-prob pass and update route through them
    mode: str

    def __post_init__(self) -> None:
        require_choice(self.mode, ROUTER_REPLAY_MODES, "mode")

    @property
    def replays(self) -> bool:
        return self.mode != "disabled"

    @property
    def rollout_records(self) -> bool:
        """Whether the rollout records its routes (R3)."""
        return self.mode == "R3"


@dataclass(kw_only=True)
class ActorConfig(UpdateConfig):
    """The policy's training side (the update's shared fields in ``UpdateConfig``)."""

    log_prob_micro_batch_size_per_gpu: int  # samples per forward when computing old log-probs
    log_prob_max_token_len_per_gpu: int  # use_dynamic_bsz: most real tokens per micro-batch for old log-probs
    param_offload: bool  # move parameter shards and gradients to CPU memory while generating (GPU; CPU: no-op)
    optimizer_offload: bool  # move the optimizer state to CPU memory while generating (GPU; CPU: no-op)
    # on-policy steps (ppo_epochs 1, mini-batch = train batch, no KL in the reward): the old log-probs come from the
    # update's own forward before its optimizer step (exact), with no separate pass
    reuse_update_log_probs: bool
    policy_loss: PolicyLossConfig  # loss_mode and clip ratios
    entropy_coeff: float  # weight of the entropy bonus (subtracted from the loss)
    use_kl_loss: bool  # add KL(pi || ref) to the loss (GRPO style) instead of / besides the reward
    kl_loss_coef: float  # weight of the KL loss
    kl_loss_type: str  # algorithms.KL_TYPES: kl | abs | mse | low_var_kl, with optional + (straight-through)
    router_replay: RouterReplayConfig  # mixture of experts: route training's tokens as the rollout routed them

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_fields(self, "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu")
        require_choice(self.kl_loss_type, KL_TYPES, "kl_loss_type")
        require(self.kl_loss_coef >= 0, "kl_loss_coef", f"must be >= 0, got {self.kl_loss_coef}")

    def single_update_step(self, mini_batch_size: int, batch_size: int) -> bool:
        """Whether an update over ``batch_size`` samples is one optimizer step on all of them (one epoch,
        one mini-batch): then the policy before that step is the one that sampled the batch, and the
        update's own log-probs are the old ones, exactly. The only statement of this condition."""
        return self.ppo_epochs == 1 and mini_batch_size == batch_size


@dataclass(kw_only=True)
class RefConfig:
    """A frozen policy that scores sampled tokens: the reference (for KL), and the teacher's settings too."""

    log_prob_micro_batch_size_per_gpu: int  # samples per forward when computing this model's log-probs
    use_remove_padding: bool  # run the forward on the packed real tokens only (no compute on padding)
    use_dynamic_bsz: bool  # micro-batches by token count (log_prob_max_token_len_per_gpu) instead of sample count
    log_prob_max_token_len_per_gpu: int  # use_dynamic_bsz: most real tokens per micro-batch on one rank
    tensor_model_parallel_size: int  # ranks that split each decoder layer of this model (DTensor); FSDP2 over the rest
    # Ulysses: ranks that hold the same rows and split each micro-batch's tokens (attention by all-to-all over heads);
    # the data-parallel ranks are the rest: world / (this x tensor_model_parallel_size); needs use_remove_padding
    ulysses_sequence_parallel_size: int
    # pipeline parallelism: ranks that split the decoder layers into stages (torch's 1F1B schedules); they hold the same
    # rows; the data-parallel ranks are the rest: world / (this x tensor_model_parallel_size); needs use_remove_padding
    pipeline_model_parallel_size: int
    # stages per pipeline rank: 1 runs the 1F1B schedule, more the interleaved 1F1B one (smaller bubble, more sends)
    virtual_pipeline_model_parallel_size: int
    fsdp: FSDPConfig

    def __post_init__(self) -> None:
        require_positive_fields(
            self, "log_prob_micro_batch_size_per_gpu", *_PARALLEL_SIZES, "log_prob_max_token_len_per_gpu"
        )


@dataclass(kw_only=True)
class CriticConfig(UpdateConfig):
    """The value model of PPO (built when algorithm.adv_estimator needs values, e.g. gae)."""

    model: TrainedModelConfig  # path "" means: the actor's model
    forward_micro_batch_size_per_gpu: int  # samples per forward when computing values
    forward_max_token_len_per_gpu: int  # use_dynamic_bsz: most real tokens per micro-batch when computing values
    cliprange_value: float  # value clipping range around the old values

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_fields(
            self, "forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu", "cliprange_value"
        )


@dataclass(kw_only=True)
class SFTEngineConfig:
    """The supervised update: micro-batches, packing, parallelism, clipping, FSDP2.

    The optimizer is the ``optim`` section's."""

    micro_batch_size_per_gpu: int  # samples per forward/backward on one rank (gradient accumulation up to the batch)
    use_remove_padding: bool  # run forward/backward on the packed real tokens only (no compute on padding)
    use_dynamic_bsz: bool  # micro-batches by token count (max_token_len_per_gpu) instead of sample count
    max_token_len_per_gpu: int  # use_dynamic_bsz: most real tokens per forward/backward micro-batch on one rank
    tensor_model_parallel_size: int  # ranks that split each decoder layer (DTensor); FSDP2 over the rest
    # Ulysses: ranks that hold the same rows and split each micro-batch's tokens (attention by all-to-all over heads);
    # the data-parallel ranks are the rest: world / (this x tensor_model_parallel_size); needs use_remove_padding
    ulysses_sequence_parallel_size: int
    # pipeline parallelism: ranks that split the decoder layers into stages (torch's 1F1B schedules); they hold the same
    # rows; the data-parallel ranks are the rest: world / (this x tensor_model_parallel_size); needs use_remove_padding
    pipeline_model_parallel_size: int
    # stages per pipeline rank: 1 runs the 1F1B schedule, more the interleaved 1F1B one (smaller bubble, more sends)
    virtual_pipeline_model_parallel_size: int
    grad_clip: float  # max global grad norm; steps with a non-finite norm are skipped
    # FSDP2: free each layer's gathered weights after its forward (true) or keep them through the micro-batches of a
    # step (false: one all-gather and cast per step instead of two per micro-batch; the whole model is held in
    # param_dtype while a step trains); null: false on CPU, true on a GPU
    reshard_after_forward: bool | None
    fsdp: FSDPConfig  # FSDP2's compute and gradient-reduction dtypes

    def __post_init__(self) -> None:
        require_positive_fields(
            self, "micro_batch_size_per_gpu", "max_token_len_per_gpu", *_PARALLEL_SIZES, "grad_clip"
        )

    def update_config(self, optim: OptimConfig) -> UpdateConfig:
        """The shared update loop's settings (engine/update.py) for one optimizer step per batch, token-mean loss."""
        return UpdateConfig(
            ppo_micro_batch_size_per_gpu=self.micro_batch_size_per_gpu,
            ppo_epochs=1,
            shuffle=False,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=1,
            router_aux_loss_coef=None,  # a mixture of experts' own weight (its config's)
            use_remove_padding=self.use_remove_padding,
            use_dynamic_bsz=self.use_dynamic_bsz,
            ppo_max_token_len_per_gpu=self.max_token_len_per_gpu,
            loss_agg_mode="token-mean",
            grad_clip=self.grad_clip,
            reshard_after_forward=self.reshard_after_forward,
            optim=optim,
            fsdp=self.fsdp,
        )
