"""Typed configs of the training engine: model, optimizer, FSDP2, actor, reference, critic."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.algorithms import PolicyLossConfig


@dataclass
class ModelConfig:
    path: str = (
        "tiny-llama"  # local Hugging Face directory, or a built-in name (tiny-llama, tiny-qwen2, smollm2-135m-instruct)
    )
    enable_gradient_checkpointing: bool = False  # recompute activations in backward to save memory


@dataclass
class OptimConfig:
    lr: float = 1e-6  # peak learning rate of AdamW
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    lr_warmup_steps: int = 0  # linear warm-up steps from 0 to lr
    lr_scheduler: str = "constant"  # after warm-up: constant | cosine
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio at the last step


@dataclass
class FSDPConfig:
    param_dtype: str = "bf16"  # compute dtype of forward/backward (bf16 | fp32); master weights stay fp32
    reduce_dtype: str = "fp32"  # dtype of the gradient reduce-scatter across ranks


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (multiplied by rollout.n samples), over all ranks
    ppo_micro_batch_size_per_gpu: int = 8  # samples per forward/backward on one rank (gradient accumulation)
    ppo_epochs: int = 1  # passes over the batch per training step
    shuffle: bool = True  # shuffle samples between mini-batches (seeded)
    log_prob_micro_batch_size_per_gpu: int = 16  # samples per forward when computing old log-probs
    use_remove_padding: bool = True  # run forward/backward on the packed real tokens only (no compute on padding)
    use_dynamic_bsz: bool = (
        False  # micro-batches by token count (the *_max_token_len_per_gpu keys) instead of sample count
    )
    ppo_max_token_len_per_gpu: int = (
        16384  # use_dynamic_bsz: most real tokens per forward/backward micro-batch on one rank
    )
    log_prob_max_token_len_per_gpu: int = (
        16384  # use_dynamic_bsz: most real tokens per micro-batch when computing old log-probs
    )
    param_offload: bool = False  # move this rank's parameter shards and gradients to CPU memory while the actor generates (GPU; a no-op on CPU)
    optimizer_offload: bool = (
        False  # move the optimizer state to CPU memory while the actor generates (GPU; a no-op on CPU)
    )
    reuse_update_log_probs: bool = True  # on-policy steps (ppo_epochs 1, mini-batch = train batch, no KL in reward): old log-probs come from the update's own forward before its optimizer step (exact), no separate pass
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  # loss_mode and clip ratios
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    entropy_coeff: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    use_kl_loss: bool = False  # add KL(pi || ref) to the loss (GRPO style) instead of / besides the reward
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # kl | abs | mse | low_var_kl, with optional + (straight-through)
    grad_clip: float = 1.0  # max global grad norm; steps with a non-finite norm are skipped
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16  # samples per forward when computing reference log-probs
    use_remove_padding: bool = True  # run the forward on the packed real tokens only (no compute on padding)
    use_dynamic_bsz: bool = (
        False  # micro-batches by token count (log_prob_max_token_len_per_gpu) instead of sample count
    )
    log_prob_max_token_len_per_gpu: int = 16384  # use_dynamic_bsz: most real tokens per micro-batch on one rank
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CriticConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=""))  # path "" means: the actor's model
    ppo_mini_batch_size: int = 8  # prompts per optimizer step, over all ranks
    ppo_micro_batch_size_per_gpu: int = 8  # samples per forward/backward on one rank
    ppo_epochs: int = 1  # passes over the batch per training step
    shuffle: bool = True  # shuffle samples between mini-batches (seeded)
    forward_micro_batch_size_per_gpu: int = 16  # samples per forward when computing values
    use_remove_padding: bool = True  # run forward/backward on the packed real tokens only (no compute on padding)
    use_dynamic_bsz: bool = (
        False  # micro-batches by token count (the *_max_token_len_per_gpu keys) instead of sample count
    )
    ppo_max_token_len_per_gpu: int = (
        16384  # use_dynamic_bsz: most real tokens per forward/backward micro-batch on one rank
    )
    forward_max_token_len_per_gpu: int = (
        16384  # use_dynamic_bsz: most real tokens per micro-batch when computing values
    )
    cliprange_value: float = 0.5  # value clipping range around the old values
    loss_agg_mode: str = "token-mean"  # aggregation of the value loss
    grad_clip: float = 1.0  # max global grad norm
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
