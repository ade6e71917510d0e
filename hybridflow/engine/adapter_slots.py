"""Many LoRA adapters over one base model in memory: the model's adapter slot, and each adapter's own state.

The model carries one peft adapter (the *slot*) of rank ``max_rank`` on every layer an adapter may adapt. Each
named adapter (a training client of the service, or the saved weights a sampler reads) keeps its own copy of the
slot's tensors, its AdamW state and its accumulated gradients here; ``activate(key)`` moves one into the model.

An adapter of rank r < max_rank uses the first r rows of A and columns of B, the rest zero; a layer it does not
adapt has A = B = 0. Both stay exactly zero while it trains: the gradient of A's row i is B[:, i]ᵀ(...) and that of
B's column i is (...)(A[i] x), each zero while the other is, and AdamW moves a parameter whose gradient and
moments are zero by nothing (weight decay scales the zero). So a rank-r adapter of some layers trains in the slot
as it would alone, and its saved tensors are cropped to rank r (a peft adapter of its own shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridflow.engine.lora import ADAPTER, base_name
from hybridflow.engine.optim import FUSED_DEVICES
from hybridflow.models.adapters import LORA_A, LORA_B, adapter_name, layer_part

ADAPTER_FILE = "adapter_model.safetensors"  # peft's file and parameter names: peft and vLLM load it as it is
OPTIMIZER_FILE = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _distributed_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` in ``like``'s layout (``full`` itself for a plain tensor)."""
    if isinstance(like, DTensor):
        return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements).to_local()
    return full.to(like.dtype)


def _full(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The full tensor of a local part kept in ``like``'s layout (every rank takes part)."""
    if isinstance(like, DTensor):
        return DTensor.from_local(
            local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
        ).full_tensor()
    return local


@dataclass
class SlotLayer:
    """One adapted layer of the slot: its plain name, its part, and its A (max_rank, in) and B (out, max_rank)."""

    name: str
    part: str | None
    a_name: str  # the parameter names in the model
    b_name: str
    module: nn.Module  # peft's LoRA layer (its ``scaling`` is the active adapter's)


@dataclass
class AdapterState:
    """One adapter: rank, parts, scaling, and its slot tensors, AdamW state and gradients (local parts)."""

    rank: int
    parts: frozenset[str]
    scaling: float
    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, dict] = field(default_factory=dict)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


class AdapterSlots:
    """The adapters held over one model, the one in the slot (``active``), and AdamW over the slot."""

    def __init__(self, model: nn.Module, max_rank: int):
        self.model = model
        self.max_rank = max_rank
        params = dict(model.named_parameters())
        self.params = params
        self.layers: list[SlotLayer] = []
        for name, module in model.named_modules():
            lora_a = getattr(module, "lora_A", None)
            if lora_a is None or ADAPTER not in lora_a:
                continue
            plain = base_name(name)
            self.layers.append(
                SlotLayer(
                    plain,
                    layer_part(plain),
                    f"{name}.lora_A.{ADAPTER}.weight",
                    f"{name}.lora_B.{ADAPTER}.weight",
                    module,
                )
            )
        self.available_parts = frozenset(layer.part for layer in self.layers if layer.part is not None)
        self.slot_names = [n for layer in self.layers for n in (layer.a_name, layer.b_name)]
        # per-step settings (lr, betas, eps, weight decay) are set on the group at each step
        slot = [params[n] for n in self.slot_names]
        fused = all(p.device.type in FUSED_DEVICES for p in slot)
        self.optimizer = torch.optim.AdamW(slot, lr=0.0, weight_decay=0.0, fused=fused or None)
        self.adapters: dict[str, AdapterState] = {}
        self.active: str | None = None

    # --- creating, dropping, moving into the slot ---

    def create(self, key: str, *, rank: int, parts: frozenset[str], scaling: float, seed: int) -> None:
        """A fresh adapter: A of its layers initialised as peft does (Kaiming-uniform, seeded), B zero."""
        self._check_new(key, rank, parts)
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in self.layers:
            a, b = self.params[layer.a_name], self.params[layer.b_name]
            full_a = torch.zeros(a.shape, dtype=torch.float32)
            if layer.part in parts:
                torch.nn.init.kaiming_uniform_(full_a[:rank], a=math.sqrt(5), generator=generator)
            tensors[layer.a_name] = _distributed_like(full_a, a).clone()
            tensors[layer.b_name] = torch.zeros_like(_local(b))
        self.adapters[key] = AdapterState(rank, parts, scaling, tensors)

    def _check_new(self, key: str, rank: int, parts: frozenset[str]) -> None:
        if key in self.adapters:
            raise ValueError(f"adapter {key!r} exists")
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"LoRA rank {rank} is outside 1..{self.max_rank} (the service's max_lora_rank)")
        missing = sorted(parts - self.available_parts)
        if missing:
            raise ValueError(
                f"this service's adapters do not reach {missing} (they reach {sorted(self.available_parts)})"
            )
        if not parts:
            raise ValueError("an adapter needs at least one part to adapt (attention, MLP or the output head)")

    def drop(self, key: str) -> None:
        if key == self.active:
            self._clear_slot()
            self.active = None
        self.adapters.pop(key, None)

    def _clear_slot(self) -> None:
        for name in self.slot_names:
            param = self.params[name]
            param.grad = None
            self.optimizer.state.pop(param, None)

    def _reshard(self) -> None:
        """Drop FSDP2's gathered copies of the weights before the sharded ones change: the root unit (the embedding
        and the output head, with the head's adapter) keeps its gathered weights after a forward, and a forward
        without a backward leaves them so: the next forward would compute with the adapter written before."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @torch.no_grad()
    def activate(self, key: str) -> AdapterState:
        """Move adapter ``key`` into the slot (the one there before keeps its tensors, state and gradients)."""
        state = self.adapters[key]
        if self.active == key:
            return state
        self._reshard()
        if self.active is not None:
            previous = self.adapters[self.active]
            for name in self.slot_names:
                param = self.params[name]
                previous.tensors[name].copy_(_local(param))
                previous.grads[name] = param.grad
                param.grad = None
                previous.optimizer[name] = self.optimizer.state.pop(param, {})
        for name in self.slot_names:
            param = self.params[name]
            _local(param).copy_(state.tensors[name])
            param.grad = state.grads.pop(name, None)
            moments = state.optimizer.pop(name, {})
            if moments:
                self.optimizer.state[param] = moments
            else:
                self.optimizer.state.pop(param, None)
        for layer in self.layers:
            layer.module.scaling[ADAPTER] = state.scaling
            # a layer the adapter does not adapt (A = B = 0) runs its base alone: an output head's zero adapter
            # would cost two passes over the logits and a matmul into them. Only the switch is flipped, as in
            # engine/lora.py ``adapters_off`` (which restores it); its tensors keep no gradient (None, not 0), which
            # the optimizer and the clipping treat as the zero they are.
            layer.module._disable_adapters = layer.part not in state.parts
        self.active = key
        return state

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # --- the optimizer step ---

    def step(self, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """One AdamW step of the active adapter with this call's settings; its gradients are then cleared."""
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._reshard()
        self.optimizer.step()
        self.zero_grad()

    # --- files: peft's adapter layout cropped to the adapter's rank ---

    def _current(self, key: str, name: str) -> torch.Tensor:
        """A slot tensor's local part of adapter ``key``: the model's when it is active."""
        return _local(self.params[name]) if key == self.active else self.adapters[key].tensors[name]

    def adapter_tensors(self, key: str) -> dict[str, torch.Tensor]:
        """Full adapted tensors of ``key`` cropped to its rank, under the names they travel to a rollout by
        (models/adapters.py): only the layers of its parts (every rank takes part)."""
        state = self.adapters[key]
        out = {}
        for layer in self.layers:
            if layer.part not in state.parts:
                continue
            a = _full(self._current(key, layer.a_name), self.params[layer.a_name])
            b = _full(self._current(key, layer.b_name), self.params[layer.b_name])
            out[adapter_name(layer.name, LORA_A)] = a[: state.rank].contiguous()
            out[adapter_name(layer.name, LORA_B)] = b[:, : state.rank].contiguous()
        return out

    def save(self, key: str, directory: Path, *, with_optimizer: bool, write: bool) -> None:
        """The adapter's tensors (peft's names, rank-cropped) and, ``with_optimizer``, its AdamW moments and step
        count into ``directory``; every rank gathers, the rank with ``write`` writes."""
        state = self.adapters[key]
        tensors = {}
        for layer in self.layers:
            if layer.part not in state.parts:
                continue
            prefix = f"base_model.model.{layer.name}"
            a = _full(self._current(key, layer.a_name), self.params[layer.a_name])
            b = _full(self._current(key, layer.b_name), self.params[layer.b_name])
            tensors[f"{prefix}.lora_A.weight"] = a[: state.rank].float().contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b[:, : state.rank].float().contiguous()
        moments = self._moments(key) if with_optimizer else {}
        if write:
            directory.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(directory / ADAPTER_FILE))
            self._adapter_config(state).save_pretrained(str(directory))
            if with_optimizer:
                save_file(moments, str(directory / OPTIMIZER_FILE))

    def _adapter_config(self, state: AdapterState):
        """peft's adapter_config.json for the saved tensors (its base model path is the service's to fill)."""
        import peft

        targets = sorted({layer.name.rsplit(".", 1)[-1] for layer in self.layers if layer.part in state.parts})
        return peft.LoraConfig(r=state.rank, lora_alpha=state.scaling * state.rank, target_modules=targets, bias="none")

    def _moments(self, key: str) -> dict[str, torch.Tensor]:
        state = self.adapters[key]
        out = {}
        for layer in self.layers:
            if layer.part not in state.parts:
                continue
            for name, crop in ((layer.a_name, lambda t: t[: state.rank]), (layer.b_name, lambda t: t[:, : state.rank])):
                param = self.params[name]
                moments = self.optimizer.state.get(param, {}) if key == self.active else state.optimizer.get(name, {})
                if not moments:
                    continue
                for moment in MOMENTS:
                    out[f"{name}.{moment}"] = crop(_full(_local(moments[moment]), param)).float().contiguous()
                out[f"{name}.step"] = torch.as_tensor(moments["step"], dtype=torch.float32).reshape(1)
        return out

    @torch.no_grad()
    def load(
        self, key: str, directory: Path, *, rank: int, parts: frozenset[str], scaling: float, with_optimizer: bool
    ) -> None:
        """A new adapter ``key`` from ``directory`` (written by ``save``), with its AdamW state when asked."""
        self._check_new(key, rank, parts)
        saved = load_file(str(directory / ADAPTER_FILE))
        tensors = {}
        for layer in self.layers:
            a, b = self.params[layer.a_name], self.params[layer.b_name]
            full_a, full_b = torch.zeros(a.shape), torch.zeros(b.shape)
            if layer.part in parts:
                prefix = f"base_model.model.{layer.name}"
                full_a[:rank] = _saved(saved, f"{prefix}.lora_A.weight", (rank, a.shape[1]), directory)
                full_b[:, :rank] = _saved(saved, f"{prefix}.lora_B.weight", (b.shape[0], rank), directory)
            tensors[layer.a_name] = _distributed_like(full_a, a).clone()
            tensors[layer.b_name] = _distributed_like(full_b, b).clone()
        state = AdapterState(rank, parts, scaling, tensors)
        if with_optimizer:
            state.optimizer = self._load_moments(directory, state)
        self.adapters[key] = state

    def _load_moments(self, directory: Path, state: AdapterState) -> dict[str, dict]:
        path = directory / OPTIMIZER_FILE
        if not path.exists():
            raise FileNotFoundError(f"{directory.name} was saved without its optimizer state")
        saved = load_file(str(path))
        out = {}
        for name in self.slot_names:
            if f"{name}.step" not in saved:
                continue
            param = self.params[name]
            moments = {}
            for moment in MOMENTS:
                full = torch.zeros(param.shape)
                value = saved[f"{name}.{moment}"]
                if name.endswith(f"lora_A.{ADAPTER}.weight"):
                    full[: state.rank] = value
                else:
                    full[:, : state.rank] = value
                moments[moment] = _distributed_like(full, param).clone()
                if isinstance(param, DTensor):
                    moments[moment] = DTensor.from_local(moments[moment], param.device_mesh, param.placements)
            # fused AdamW keeps the step as a float tensor on the parameter's device
            moments["step"] = saved[f"{name}.step"].reshape(()).to(_local(param).device)
            out[name] = moments
        return out


def _saved(saved: dict[str, torch.Tensor], name: str, shape: tuple[int, int], directory: Path) -> torch.Tensor:
    tensor = saved.get(name)
    if tensor is None or tuple(tensor.shape) != shape:
        got = "missing" if tensor is None else tuple(tensor.shape)
        raise ValueError(f"{directory}: {name} should be {shape}, is {got}")
    return tensor
