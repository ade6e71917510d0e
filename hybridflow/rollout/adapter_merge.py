"""A LoRA policy on a rollout engine that takes only whole weights: the engine's adapted weights are
rewritten as W + scaling · B A from a copy of the base W that this side keeps.

The copy is what makes every sync exact: merging into the engine's own weights in place
(W ← W + scaling · (B A − B' A')) would add the engine dtype's rounding error at every sync (bf16: about
2^-9 of each weight), and the drift would grow with the run. The price is a second copy of the base on the
rollout's device (in the engine's dtype); an engine that serves the adapters itself (the native engine's
``rollout.native.adapters: served``) needs no copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from hybridflow.models.adapters import LORA_A, LORA_B, adapted_weight, adapter_delta, split_adapter_name


class AdapterMerge:
    """The rollout side's copy of the base and the merge. every_weight: the engine needs every weight at each
    load (vLLM's reload), not only the adapted ones."""

    def __init__(self, *, every_weight: bool):
        self.every_weight = every_weight
        self.base: dict[str, torch.Tensor] = {}

    def keep(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the base weights through (to the engine's load), keeping a copy of each."""
        for name, tensor in named_tensors:
            self.base[name] = tensor.detach().clone()
            yield name, tensor

    @torch.no_grad()
    def merged(
        self, adapters: Iterable[tuple[str, torch.Tensor]], scaling: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapted weights W + scaling · B A (in fp32, returned in W's dtype) as each layer's pair arrives;
        then, with ``every_weight``, the base weights of the layers no adapter came for."""
        if not self.base:
            raise RuntimeError("adapters came before the base weights: load_base_weights must come first")
        waiting: dict[str, dict[str, torch.Tensor]] = {}
        done: set[str] = set()
        for name, tensor in adapters:
            layer, part = split_adapter_name(name)
            parts = waiting.setdefault(layer, {})
            parts[part] = tensor
            if len(parts) < 2:
                continue
            del waiting[layer]
            weight_name = adapted_weight(layer, self.base)
            base = self.base.get(weight_name)
            if base is None:
                raise KeyError(f"adapters for {layer}, whose base weight {weight_name} never came")
            lora_a, lora_b = (parts[p].to(base.device, torch.float32) for p in (LORA_A, LORA_B))
            delta = adapter_delta(base.shape, lora_a, lora_b)
            done.add(weight_name)
            yield weight_name, (base.float() + scaling * delta).to(base.dtype)
        if waiting:
            raise ValueError(f"layers with one adapter of the two: {sorted(waiting)}")
        if self.every_weight:
            for name, tensor in self.base.items():
                if name not in done:
                    yield name, tensor
        else:  # the copy of a weight no adapter names is never needed again
            self.base = {name: tensor for name, tensor in self.base.items() if name in done}
