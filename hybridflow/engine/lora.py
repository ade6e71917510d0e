"""LoRA adapters on a role's model, built by peft: the settings, the wrapping, the adapters-off context (the
reference policy) and the merged weights a rollout engine takes.

Only the adapter matrices train: peft freezes the base, so the base has no gradients, no optimizer state and
(with ``frozen_dtype``) no fp32 master copy. A wrapped linear layer computes

    y = x W^T + scaling · (x A^T) B^T,      scaling = alpha / rank

so the weight it stands for is W + scaling · B A (``merged_parameters``). A mixture's experts, one 3-D parameter
per projection (E, out, in), are adapted through peft's ``target_parameters``: each expert e gets its own
B_e A_e (models/adapters.py ``adapter_delta``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridflow.models.adapters import LORA_A, LORA_B, adapted_layer, adapter_delta, adapter_name, expert_factors
from hybridflow.validation import require

ALL_LINEAR = "all-linear"  # every linear layer of the decoder (not the output head), as peft reads it
OUTPUT_HEAD = "lm_head"  # beside ALL_LINEAR: the output head too (the training service's adapter slot)
PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's parameter names
BASE_LAYER = ".base_layer"  # where peft moves a wrapped layer's own weight
ADAPTER = "default"  # the adapter's name in peft (one adapter per model here)


@dataclass(kw_only=True)
class LoraConfig:
    rank: int  # LoRA rank r of every adapter (0: off, the whole model trains)
    alpha: float  # the adapters' output is scaled by alpha / rank
    dropout: float  # dropout on the adapters' input while training
    # linear layers to adapt, by the last part of their name (q_proj, v_proj, ...), or [all-linear]
    target_modules: list[str]
    # a mixture's expert weights to adapt, each expert with its own adapter (peft's target_parameters), by the end
    # of their name: [experts.gate_up_proj, experts.down_proj]; [] for none
    target_parameters: list[str]

    def __post_init__(self) -> None:
        require(self.rank >= 0, "rank", f"must be 0 (off) or more, got {self.rank}", "set rank to e.g. 8, or 0")
        require(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        require(
            not self.enabled or bool(self.target_modules or self.target_parameters),
            "target_modules",
            "is empty: LoRA needs layers to adapt",
            f"name them (q_proj, v_proj, ...) or [{ALL_LINEAR}]",
        )
        require(
            not (self.enabled and self.target_parameters and self.dropout),
            "dropout",
            f"must be 0 with target_parameters: peft's expert adapters take no dropout, got {self.dropout}",
            "set dropout to 0.0, or target_parameters to []",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def linear_layer_names(model: nn.Module) -> set[str]:
    """The last part of the name of every linear layer in the decoder (the output head left out): what
    ``target_modules`` may name. Works on a model built on the meta device."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head
    }


def expert_weight_names(model: nn.Module) -> set[str]:
    """What ``target_parameters`` may name: each 3-D (expert) parameter by the last two parts of its name
    (experts.gate_up_proj). Works on a model built on the meta device."""
    names = (base_name(name) for name, parameter in model.named_parameters() if parameter.dim() == 3)
    return {".".join(name.split(".")[-2:]) for name in names}


def target_problem(targets: list[str], available: set[str]) -> str | None:
    """Why ``targets`` cannot be adapted on a model whose linear layers are ``available`` (None: they can)."""
    if targets == [ALL_LINEAR]:
        return None
    unknown = sorted(set(targets) - available)
    if not unknown:
        return None
    return f"{unknown} name no linear layer of this model; its linear layers are {sorted(available)}"


def heads(model: nn.Module) -> list[str]:
    """The task heads a LoRA model trains whole: linear layers right under the model other than the
    language-model head (a critic's value head, ``score``). A causal LM has none."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_children() if isinstance(module, nn.Linear) and module is not output]


def apply_lora(model: nn.Module, config: LoraConfig, frozen_dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` with LoRA adapters on ``config.target_modules`` (peft); a task head (``heads``) trains whole;
    the rest is frozen, and cast to ``frozen_dtype`` when given (it needs no fp32 master: it never updates).
    What trains stays fp32."""
    import peft

    whole = heads(model)
    if config.target_modules in ([ALL_LINEAR], [ALL_LINEAR, OUTPUT_HEAD]):
        targets = sorted(linear_layer_names(model) - set(whole)) + config.target_modules[1:]
    else:
        targets = list(config.target_modules)
    settings = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        target_parameters=list(config.target_parameters) or None,
        modules_to_save=whole or None,
        bias="none",
    )
    if config.target_parameters:
        transposed = [name for name, module in model.named_modules() if getattr(module, "is_transposed", False)]
        if transposed:
            raise ValueError(f"{transposed[0]} stores its experts as (E, in, out); expert adapters assume (E, out, in)")
    wrapped = peft.get_peft_model(model, settings)
    if frozen_dtype is not None:
        for parameter in wrapped.parameters():
            if not parameter.requires_grad:
                parameter.data = parameter.data.to(frozen_dtype)
    return wrapped


def is_lora(model: nn.Module) -> bool:
    return any(name.endswith(f"lora_A.{ADAPTER}.weight") for name, _ in model.named_parameters())


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model's forward inside the block: the reference policy of a LoRA actor.

    Only each adapted layer's switch is flipped. peft's own ``disable_adapter()`` also marks the adapters as not
    requiring gradients while they are off, and FSDP2 fixes a parameter group's gradient dtype at the model's
    first forward from the parameters that require gradients then: a first forward with the adapters off (the
    reference before any update) left only the frozen bf16 base, and the adapters' fp32 gradients were then
    cast to bf16 and refused.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    switches = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, switch in zip(layers, switches, strict=True):
            layer._disable_adapters = switch


def base_name(name: str) -> str:
    """A peft parameter name as the plain Hugging Face model names it."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(BASE_LAYER, "")


def adapted_weights(model: nn.Module) -> dict[str, str]:
    """The plain name of the weight each peft adapter adapts, by the name of the module that holds the adapter:
    a linear layer's ``<layer>.weight``, or the expert parameter a ``target_parameters`` wrapper names (peft nests
    one wrapper per parameter, so only the wrapper knows which of the experts' weights its adapter is for)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            adapted[name] = f"{base_name(name)}.{getattr(module, 'parameter_name', None) or 'weight'}"
    return adapted


def expert_adapters(wrapped: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """(the experts module, peft's wrapper of each of its adapted weights by the weight's name) of what a MoE block
    holds as its experts: peft nests one wrapper per adapted parameter around the module (none: no adapters)."""
    wrappers = {}
    while isinstance(getattr(wrapped, "base_layer", None), nn.Module):
        wrappers[wrapped.parameter_name] = wrapped
        wrapped = wrapped.base_layer
    return wrapped, wrappers


def expert_adapter_delta(
    wrapper: nn.Module,
    first: int,
    count: int,
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """scaling · B_e A_e (count, out, in) of experts ``first``..``first + count`` of a peft ``target_parameters``
    wrapper (in its adapters' dtype); None while its adapters are off (``adapters_off``). What a rank holding some
    of the experts (expert or tensor parallelism) adds to them, the forward peft's own wrapper would run needing all
    of them. ``shared``: applied to A and B first (tensor parallelism sums their gradients over its ranks there)."""
    if wrapper.disable_adapters or ADAPTER not in wrapper.active_adapters:
        return None
    lora_a, lora_b = wrapper.lora_A[ADAPTER].weight, wrapper.lora_B[ADAPTER].weight
    if shared is not None:
        lora_a, lora_b = shared(lora_a), shared(lora_b)
    per_expert_a, per_expert_b = expert_factors(lora_a, lora_b, wrapper.num_experts)
    held = slice(first, first + count)
    return wrapper.scaling[ADAPTER] * torch.bmm(per_expert_b[held], per_expert_a[held])


def _lora_part(name: str) -> tuple[str, str] | None:
    """(prefix of the module holding it, LORA_A or LORA_B) of a peft adapter parameter's name; None otherwise."""
    for part in (LORA_A, LORA_B):
        marker = f".{part}.{ADAPTER}.weight"
        if name.endswith(marker):
            return name[: -len(marker)], part
    return None


def _weight_of(prefix: str, adapted: Mapping[str, str]) -> str:
    return adapted.get(prefix) or base_name(prefix) + ".weight"


def merged_parameters(
    named: Iterable[tuple[str, torch.Tensor]], scaling: float, adapted: Mapping[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors of a LoRA model (``named``: peft's names, in the model's order) as the plain model's
    parameters, each adapted weight merged: W + scaling · B A (computed in fp32, returned in W's dtype).
    ``adapted``: ``adapted_weights`` of the model, needed when it adapts expert parameters.

    A wrapped layer's base weight comes before its lora_A and lora_B, so it is held until both have come."""
    adapted = adapted or {}
    adapted_names = set(adapted.values())
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # plain weight name -> what has come of it
    for name, tensor in named:
        part = _lora_part(name)
        if part is not None:
            key, which = _weight_of(part[0], adapted), part[1]
        elif BASE_LAYER + ".weight" in name or base_name(name) in adapted_names:
            key, which = base_name(name), "W"
        else:
            yield base_name(name), tensor
            continue
        parts = waiting.setdefault(key, {})
        parts[which] = tensor
        if len(parts) == 3:
            del waiting[key]
            yield key, _merged(parts["W"], parts[LORA_A], parts[LORA_B], scaling)
    if waiting:
        raise ValueError(f"adapted layers without their base weight or both adapters: {sorted(waiting)}")


def _merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling · B A in fp32, in W's dtype. Sharded (DTensors), a linear layer's product stays sharded; an
    expert weight's adapters (a few rows each) are gathered whole and the product cut to W's own shards."""
    if weight.dim() == 3 and isinstance(weight, DTensor):
        whole = [t.full_tensor() if isinstance(t, DTensor) else t for t in (lora_a, lora_b)]
        delta = adapter_delta(weight.shape, whole[0].float(), whole[1].float())
        delta = distribute_tensor(delta.detach(), weight.device_mesh, weight.placements, src_data_rank=None)
    else:
        delta = adapter_delta(weight.shape, lora_a.float(), lora_b.float())
    return (weight.float() + scaling * delta).to(weight.dtype)


def save_adapter_config(model: nn.Module, base_model: str, directory: Path) -> None:
    """peft's adapter_config.json of ``model``'s adapter, naming ``base_model`` (the model directory)."""
    settings = copy.copy(model.peft_config[ADAPTER])
    settings.base_model_name_or_path = base_model
    settings.save_pretrained(str(directory))


def lora_scaling(model: nn.Module) -> float | None:
    """alpha / rank of a LoRA model's adapter (None: not a LoRA model)."""
    settings = getattr(model, "peft_config", {}).get(ADAPTER)
    return None if settings is None else settings.lora_alpha / settings.r


def policy_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the plain model's names, one at a time: a LoRA model's merged (their
    adapters folded in; DTensor shards merge as DTensors), any other model's as they are. What every weight
    path out of the trainer (the switch to generation, the transfer to a rollout pool, an export) sends."""
    scaling = lora_scaling(model)
    if scaling is None:
        yield from model.named_parameters()
        return
    for name, tensor in merged_parameters(model.named_parameters(), scaling, adapted_weights(model)):
        yield name, tensor.detach()


def policy_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's buffers under the plain model's names."""
    for name, buffer in model.named_buffers():
        yield base_name(name), buffer


def base_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA model's frozen base under the plain model's names (adapted layers' weights without their
    adapters), one at a time: what a rollout engine holds under the adapters (``adapter_tensors``)."""
    for name, tensor in model.named_parameters():
        if _lora_part(name) is None:
            yield base_name(name), tensor.detach()


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA policy's adapters under the names they travel by (models/adapters.py), in the model's order:
    with ``base_parameters`` the whole policy, and all of it that trains. ValueError for a model that trains
    anything else (a head trained whole, which an adapter-sized sync would leave behind)."""
    adapted = adapted_weights(model)
    for name, tensor in model.named_parameters():
        found = _lora_part(name)
        if found is not None:
            yield adapter_name(adapted_layer(_weight_of(found[0], adapted)), found[1]), tensor.detach()
        elif tensor.requires_grad:
            raise ValueError(f"{name} trains whole: a sync of the adapters alone would not carry it")
