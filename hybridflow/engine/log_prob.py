"""The log-prob pass of a policy over a batch, written once for the actor (old log-probs) and the
reference (reference log-probs): micro-batched by the role's ``log_prob_*`` settings, timed, with
its FLOP/s as metrics."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.engine.config import ActorConfig, RefConfig
from hybridflow.engine.flops import PassMeter, pass_work
from hybridflow.engine.forward import batched_log_probs
from hybridflow.models.routing import RouteReplay
from hybridflow.protocol import DataProto


def log_prob_pass(
    model: nn.Module,
    meter: PassMeter,
    data: DataProto,
    config: ActorConfig | RefConfig,
    *,
    pass_name: str,
    temperature: float,
    with_entropy: bool,
    sp_group: dist.ProcessGroup | None = None,
    replay_routes: RouteReplay | None = None,
    routes: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Log-probs of ``data``'s response tokens and their entropy (None unless ``with_entropy``), (B, R)
    each, without grad; and the pass's metrics ``perf/mfu_<pass_name>``, ``perf/tflops_<pass_name>``,
    ``perf/peak_tflops``. ``sp_group``: Ulysses sequence parallelism over its ranks (which all hold ``data``);
    ``replay_routes``: a mixture of experts routes through the batch's recorded experts (models/routing.py);
    ``routes``: a list that receives the experts it routed each token to, (B, P+R, L, k)."""
    model.eval()
    start = time.perf_counter()
    log_probs, entropy = batched_log_probs(
        model,
        data,
        config.log_prob_micro_batch_size_per_gpu,
        temperature,
        with_entropy,
        remove_padding=config.use_remove_padding,
        max_token_len=config.log_prob_max_token_len_per_gpu if config.use_dynamic_bsz else None,
        sp_group=sp_group,
        replay_routes=replay_routes,
        routes=routes,
    )
    work = pass_work(data, config.use_remove_padding)
    metrics = meter.metrics(pass_name, work, time.perf_counter() - start, training=False)
    return log_probs, entropy, metrics
