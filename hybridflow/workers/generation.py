"""What every generating worker shares: the sampling settings of one ``generate_sequences`` call, and building
the rollout engine (with its agent loops' tools) on a worker's generation group."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hybridflow.batch_keys import GLOBAL_STEP, RECORD_ROUTES, SAMPLING, SAMPLING_ROUND
from hybridflow.controller.decorator import MeshCoord
from hybridflow.models import load_causal_lm
from hybridflow.rollout.base import Rollout
from hybridflow.rollout.build import build_rollout
from hybridflow.rollout.config import RolloutConfig
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.tools import load_tools


def call_sampling(config: RolloutConfig, meta_info: dict, coord: MeshCoord) -> SamplingParams:
    """The call's settings: training (rollout.*), validation (rollout.val_kwargs) or greedy (ReMax's baseline),
    seeded by the step and the generation group's index ``coord`` (its ranks sample alike). Dynamic sampling's
    round r of a step samples as groups r·G .. r·G+G-1 would, so seeds stay distinct. The same on the hybrid
    actor and on a rollout pool of as many generation groups: both generate the same samples."""
    rank = coord.dp_rank + int(meta_info.get(SAMPLING_ROUND, 0)) * coord.dp_size
    seed = config.sampling_seed(step=int(meta_info[GLOBAL_STEP]), rank=rank)
    sampling = meta_info[SAMPLING]
    if sampling == "greedy":
        return SamplingParams.greedy(max_new_tokens=config.response_length, seed=seed)
    source = config.val_kwargs if sampling == "validate" else config
    params = SamplingParams.from_config(source, max_new_tokens=config.response_length, seed=seed)
    return dataclasses.replace(params, record_routes=bool(meta_info.get(RECORD_ROUTES, False)))


def build_generator(
    model_path: str,
    tokenizer,
    config: RolloutConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None,
    stage_group: dist.ProcessGroup | None = None,
    tool_config: str,
    default_agent: str,
) -> Rollout:
    """The rollout engine of ``config.name`` over the generation ``group`` (None: this rank alone), in pipeline
    stages over ``stage_group`` (None: every layer on this rank), starting
    from the model directory's weights in ``dtype``, with the tools of a multi-turn run."""
    generator = load_causal_lm(model_path, dtype=dtype).to(device)
    tools = load_tools(tool_config) if config.multi_turn.enable and tool_config else None
    # the rollout keeps its own copy (1/tg of the weights); ``generator`` goes when this returns
    return build_rollout(
        generator, tokenizer, config, group, pp_group=stage_group, tools=tools, default_agent=default_agent
    )
