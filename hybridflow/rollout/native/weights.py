"""The engine's own copy of the weights: q/k/v and gate/up fused into single matrices.

Every tensor here is written through one name map (`Weights.target`), from Hugging Face
parameter names, both when the engine is built from a model and when the trainer pushes
new weights (`Weights.load`), so the two paths cannot drift apart. Fused matrices are
filled slice by slice in place: no update ever allocates.

Under tensor parallelism (parallel.py) the copy holds this rank's slice of each decoder layer, and
every tensor it is given is that slice (`TensorParallelGroup.shard` of the full one).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridflow.models.adapters import LORA_A, LORA_B, expert_factors, split_adapter_name
from hybridflow.rollout.native.linear import AdapterBlock, ExpertLowRank, ExpertMatrices, LowRank, Matrix
from hybridflow.rollout.native.parallel import TensorParallelGroup
from hybridflow.rollout.native.spec import ModelSpec
from hybridflow.rollout.native.stages import ONE_STAGE, PipelineStageGroup

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")  # buffers the forward recomputes


@dataclass
class Experts:
    """A layer's mixture of experts: E experts of width I, each token routed to ``top_k`` of them."""

    router: torch.Tensor  # (E, H): every expert's row, on every rank
    gate_up: torch.Tensor  # (E', 2I, H): rows gate | up, Hugging Face's fused layout; E' = E / tg, this rank's experts
    down: torch.Tensor  # (E', H, I)
    top_k: int
    first: int = 0  # the index of this rank's first expert (TensorParallelGroup.experts)
    renormalize: bool = True  # the chosen weights rescaled to sum to 1 (ModelSpec.normalize_top_k)
    round_weights: bool = False  # the chosen weights rounded to the hidden dtype (ModelSpec.round_routing_weights)
    gate_up_adapter: ExpertLowRank | None = None  # a LoRA policy's adapters on gate_up, served (``load_adapters``)
    down_adapter: ExpertLowRank | None = None
    matrices: ExpertMatrices = field(init=False)  # each expert's gate_up and down, as the forward multiplies them

    def __post_init__(self) -> None:
        self.matrices = ExpertMatrices(self.gate_up, self.down)


@dataclass
class LayerWeights:
    """One decoder block; shapes with H = hidden, Q = Hq*D, K = Hkv*D, I = intermediate."""

    input_norm: torch.Tensor  # (H,)
    qkv: Matrix  # weight (Q + 2K, H): rows q | k | v; bias (Q + 2K,) for Qwen2
    o: Matrix  # weight (H, Q); bias (H,) if the model has one
    post_norm: torch.Tensor  # (H,)
    gate_up: Matrix | None  # weight (2I, H): rows gate | up (None: the layer's MLP is ``experts``)
    down: Matrix | None  # weight (H, I)
    experts: Experts | None = None  # a mixture of experts in place of the dense MLP
    q_norm: torch.Tensor | None = None  # RMSNorm weight on the queries: (D,) per head or (Q,) whole (ModelSpec.qk_norm)
    k_norm: torch.Tensor | None = None  # on the keys: (D,) or (K,)

    def matrices(self) -> list[Matrix]:
        return [m for m in (self.qkv, self.o, self.gate_up, self.down) if m is not None]


@dataclass
class Weights:
    spec: ModelSpec  # the shapes this rank computes (1/tp of the heads and MLP width: tp.local_spec)
    embed: torch.Tensor  # (V, H)
    layers: list[LayerWeights]
    norm: torch.Tensor  # (H,)
    lm_head: Matrix  # weight (V, H); the same tensor as `embed` when tied
    tp: TensorParallelGroup  # the ranks this copy is split over (size 1: a whole copy)
    stages: PipelineStageGroup = ONE_STAGE  # the ranks whose layers make one model (size 1: all here)

    @property
    def model_layers(self) -> int:
        """The decoder layers of the whole model, every stage's."""
        return self.spec.num_layers * self.stages.size

    @property
    def held_layers(self) -> range:
        """The Hugging Face indices of the decoder layers this copy holds."""
        return self.stages.held_layers(self.spec.num_layers)

    def _layer(self, index: int) -> LayerWeights | None:
        """The layer of Hugging Face index ``index`` (None: another pipeline stage holds it); IndexError for an index
        the model does not have."""
        if not 0 <= index < self.model_layers:
            raise IndexError(f"layer {index}: the model has {self.model_layers} decoder layers")
        held = self.held_layers
        return self.layers[index - held.start] if index in held else None

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallelGroup,
        stages: PipelineStageGroup = ONE_STAGE,
    ) -> Weights:
        """Uninitialised weights of this rank's shapes (fill them with `load`); spec: the whole model's;
        tp: the group they are split over (size 1: a whole copy); stages: the pipeline stages its layers are
        split into (size 1: every layer here)."""
        spec = stages.local_spec(tp.local_spec(spec))
        o_bias = o_bias and tp.holds("self_attn.o_proj.bias")
        h, q, k, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=device)

        e = spec.num_experts

        def experts() -> Experts | None:
            if not e:
                return None
            routing = dict(renormalize=spec.normalize_top_k, round_weights=spec.round_routing_weights)
            held = tp.experts(e)
            gate_up, down = empty(len(held), 2 * i, h), empty(len(held), h, i)
            return Experts(empty(e, h), gate_up, down, spec.experts_per_token, first=held.start, **routing)

        q_norm, k_norm = {"head": (spec.head_dim,) * 2, "full": (q, k)}.get(spec.qk_norm, (0, 0))  # sizes; 0: none

        layers = [
            LayerWeights(
                input_norm=empty(h),
                qkv=Matrix(empty(q + 2 * k, h), empty(q + 2 * k) if qkv_bias else None),
                o=Matrix(empty(h, q), empty(h) if o_bias else None),
                post_norm=empty(h),
                gate_up=None if e else Matrix(empty(2 * i, h)),
                down=None if e else Matrix(empty(h, i)),
                experts=experts(),
                q_norm=empty(q_norm) if q_norm else None,
                k_norm=empty(k_norm) if k_norm else None,
            )
            for _ in range(spec.num_layers)
        ]
        embed = empty(spec.vocab_size, h)
        lm_head = Matrix(embed if spec.tie_word_embeddings else empty(spec.vocab_size, h))
        return cls(spec=spec, embed=embed, layers=layers, norm=empty(h), lm_head=lm_head, tp=tp, stages=stages)

    def matrices(self) -> list[Matrix]:
        """Every weight matrix that a forward multiplies by."""
        return [m for layer in self.layers for m in layer.matrices()] + [self.lm_head]

    def nbytes(self) -> int:
        """Bytes of this rank's weights (a tied LM head once; not the packed copies that `Matrix` keeps
        for oneDNN on CPU in bf16, which double the matrices' share there)."""
        tensors = [self.embed, self.norm, self.lm_head.weight]
        for layer in self.layers:
            tensors += [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm) if t is not None]
            tensors += [t for m in layer.matrices() for t in (m.weight, m.bias) if t is not None]
            if layer.experts is not None:
                tensors += [layer.experts.router, layer.experts.gate_up, layer.experts.down]
        unique = {id(t): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        spec: ModelSpec,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        stages: PipelineStageGroup = ONE_STAGE,
    ) -> Weights:
        """A packed copy of a Hugging Face causal LM's weights (a family of SUPPORTED_MODEL_TYPES) in `dtype` (this
        rank's slices of them under tensor parallelism, its stage's layers under pipeline stages)."""
        params = dict(model.named_parameters())
        attn = "model.layers.0.self_attn"
        device = next(model.parameters()).device
        weights = cls.allocate(
            spec, f"{attn}.q_proj.bias" in params, f"{attn}.o_proj.bias" in params, dtype, device, tp, stages
        )
        shards = ((name, weights.tp.shard(name, tensor)) for name, tensor in params.items())
        missing = sorted(set(weights.target_names()) - weights.load(shards))
        if missing:
            raise ValueError(f"the model lacks {len(missing)} tensors the engine needs, e.g. {missing[:3]}")
        return weights

    def target_names(self) -> list[str]:
        """Every Hugging Face parameter name this copy is filled from (lm_head only when untied)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.spec.tie_word_embeddings:
            names.append("lm_head.weight")
        layer = self.layers[0]
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
        per_layer += [f"self_attn.{p}_proj.weight" for p in "qkv"]
        if layer.experts is None:
            per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        else:
            per_layer += ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if layer.qkv.bias is not None:
            per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if layer.q_norm is not None:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if layer.o.bias is not None:
            per_layer.append("self_attn.o_proj.bias")
        return names + [f"model.layers.{i}.{p}" for i in self.held_layers for p in per_layer]

    def target(self, name: str) -> tuple[torch.Tensor, Matrix | ExpertMatrices | None] | None:
        """Where HF parameter `name` is copied: (tensor or slice of a fused one, its Matrix if any); None: ignored
        (a buffer the forward recomputes, a bias another tensor-parallel rank adds, a layer another stage holds)."""
        if name.endswith(_IGNORED_SUFFIXES) or not self.tp.holds(name):
            return None
        if name == "model.embed_tokens.weight":
            return self.embed, self.lm_head if self.lm_head.weight is self.embed else None
        if name == "model.norm.weight":
            return self.norm, None
        if name == "lm_head.weight":
            return self.lm_head.weight, self.lm_head
        match = _LAYER.fullmatch(name)
        if match is None:
            raise KeyError(f"native rollout has no weight for {name!r}")
        layer, part = self._layer(int(match.group(1))), match.group(2)
        if layer is None:
            return None
        q, k, i = self.spec.q_size, self.spec.kv_size, self.spec.intermediate_size
        slices = {"q": slice(0, q), "k": slice(q, q + k), "v": slice(q + k, q + 2 * k)}
        direct = {
            "input_layernorm.weight": (layer.input_norm, None),
            "post_attention_layernorm.weight": (layer.post_norm, None),
            "self_attn.o_proj.weight": (layer.o.weight, layer.o),
            "self_attn.o_proj.bias": (layer.o.bias, layer.o),
            "self_attn.q_norm.weight": (layer.q_norm, None),
            "self_attn.k_norm.weight": (layer.k_norm, None),
        }
        if layer.experts is None:
            direct["mlp.gate_proj.weight"] = (layer.gate_up.weight[:i], layer.gate_up)
            direct["mlp.up_proj.weight"] = (layer.gate_up.weight[i:], layer.gate_up)
            direct["mlp.down_proj.weight"] = (layer.down.weight, layer.down)
        else:
            direct["mlp.gate.weight"] = (layer.experts.router, None)
            direct["mlp.experts.gate_up_proj"] = (layer.experts.gate_up, layer.experts.matrices)
            direct["mlp.experts.down_proj"] = (layer.experts.down, layer.experts.matrices)
        for p, rows in slices.items():
            direct[f"self_attn.{p}_proj.weight"] = (layer.qkv.weight[rows], layer.qkv)
            if layer.qkv.bias is not None:
                direct[f"self_attn.{p}_proj.bias"] = (layer.qkv.bias[rows], layer.qkv)
        found = direct.get(part)
        if found is None or found[0] is None:
            raise KeyError(f"native rollout has no weight for {name!r}")
        return found

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each (HF name, tensor: this rank's slice of it) into place (casting dtype/device); returns
        the names used.

        Matrices written to are repacked (in place) at the end.
        """
        used, touched = set(), {}
        for name, tensor in named_tensors:
            found = self.target(name)
            if found is None:
                continue
            target, matrix = found
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.copy_(tensor)
            if matrix is not None:
                touched[id(matrix)] = matrix
            used.add(name)
        for matrix in touched.values():
            matrix.repack()
        return used

    def adapted_rows(self, layer_name: str) -> tuple[Matrix, slice]:
        """The matrix that HF linear layer ``layer_name`` (e.g. model.layers.0.self_attn.k_proj, or lm_head) lives
        in, and its rows there."""
        if layer_name == "lm_head":  # a tied head's Matrix is its own: an adapter on it leaves the embedding as is
            return self.lm_head, slice(None)
        match = _LAYER.fullmatch(layer_name)
        if match is None:
            raise KeyError(f"native rollout cannot serve adapters on {layer_name!r}: not a decoder layer's linear")
        layer, part = self._layer(int(match.group(1))), match.group(2)
        if layer is None:
            raise KeyError(f"{layer_name}: another generation pipeline stage holds this layer")
        q, k, i = self.spec.q_size, self.spec.kv_size, self.spec.intermediate_size
        rows = {
            "self_attn.q_proj": (layer.qkv, slice(0, q)),
            "self_attn.k_proj": (layer.qkv, slice(q, q + k)),
            "self_attn.v_proj": (layer.qkv, slice(q + k, q + 2 * k)),
            "self_attn.o_proj": (layer.o, slice(None)),
        }
        if layer.experts is None:
            rows["mlp.gate_proj"] = (layer.gate_up, slice(0, i))
            rows["mlp.up_proj"] = (layer.gate_up, slice(i, 2 * i))
            rows["mlp.down_proj"] = (layer.down, slice(None))
        if part not in rows:
            raise KeyError(f"native rollout cannot serve adapters on {layer_name!r}: not a decoder layer's linear")
        return rows[part]

    @torch.no_grad()
    def load_adapters(self, adapters: Iterable[tuple[str, torch.Tensor]], scaling: float) -> None:
        """Serve a LoRA policy's adapters (``<layer>.lora_A`` / ``.lora_B``, models/adapters.py) from now on:
        every adapted layer computes x W^T + scaling · (x A^T) B^T, its W untouched. Replaces the adapters
        served before; a matrix no adapter names has none. Under tensor parallelism each adapter is this rank's
        slice (``LayerSplit.shard_dim``): a row-split matrix's partial sums then include the adapters' own,
        and the all-reduce after it completes both."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in adapters:
            layer, part = split_adapter_name(name)
            pairs.setdefault(layer, {})[part] = tensor
        for layer, parts in pairs.items():
            if set(parts) != {LORA_A, LORA_B}:
                raise ValueError(f"{layer}: came with {sorted(parts)}, needs both {LORA_A} and {LORA_B}")
        self._load_expert_adapters(pairs, scaling)
        per_matrix: dict[int, tuple[Matrix, list[tuple[slice, torch.Tensor, torch.Tensor]]]] = {}
        for layer, parts in pairs.items():
            matrix, rows = self.adapted_rows(layer)
            out_rows = len(range(*rows.indices(matrix.weight.shape[0])))
            lora_a, lora_b = parts[LORA_A], parts[LORA_B]
            if lora_a.shape[1] != matrix.weight.shape[1] or lora_b.shape != (out_rows, lora_a.shape[0]):
                raise ValueError(
                    f"{layer}: adapters of shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit a "
                    f"layer of {out_rows} outputs and {matrix.weight.shape[1]} inputs"
                )
            per_matrix.setdefault(id(matrix), (matrix, []))[1].append((rows, lora_a, lora_b))
        dtype, device = self.embed.dtype, self.embed.device
        for matrix in self.matrices():
            matrix.adapter = None
        for matrix, found in per_matrix.values():
            found.sort(key=lambda item: item[0].start or 0)
            blocks, start = [], 0
            for rows, lora_a, _ in found:
                blocks.append((rows, slice(start, start + lora_a.shape[0])))
                start += lora_a.shape[0]
            stacked = torch.cat([a for _, a, _ in found]).to(device=device, dtype=dtype)
            matrix.adapter = LowRank(
                lora_a=stacked,
                blocks=[
                    AdapterBlock(rows, columns, b.to(device=device, dtype=dtype))
                    for (rows, columns), (_, _, b) in zip(blocks, found)
                ],
                scaling=scaling,
            )

    def _load_expert_adapters(self, pairs: dict[str, dict[str, torch.Tensor]], scaling: float) -> None:
        """Serve the adapters on expert weights (``<...>.mlp.experts.gate_up_proj``, models/adapters.py) found in
        ``pairs``, taking them out of it; every other expert weight's adapters go."""
        dtype, device = self.embed.dtype, self.embed.device
        for index, layer in zip(self.held_layers, self.layers):
            if layer.experts is None:
                continue
            experts = layer.experts
            for projection, weight, attribute in (
                ("gate_up_proj", experts.gate_up, "gate_up_adapter"),
                ("down_proj", experts.down, "down_adapter"),
            ):
                name = f"model.layers.{index}.mlp.experts.{projection}"
                parts = pairs.pop(name, None)
                if parts is None:
                    setattr(experts, attribute, None)
                    continue
                held = slice(experts.first, experts.first + weight.shape[0])  # adapters come whole (LayerSplit)
                lora_a, lora_b = (f[held] for f in expert_factors(parts[LORA_A], parts[LORA_B], len(experts.router)))
                if lora_a.shape[2] != weight.shape[2] or lora_b.shape[1] != weight.shape[1]:
                    raise ValueError(
                        f"{name}: adapters of shapes A {tuple(parts[LORA_A].shape)}, B {tuple(parts[LORA_B].shape)} "
                        f"do not fit experts of shape {tuple(weight.shape)}"
                    )
                adapter = ExpertLowRank(
                    lora_a.to(device, dtype).contiguous(), lora_b.to(device, dtype).contiguous(), scaling
                )
                setattr(experts, attribute, adapter)
