"""How tensor parallelism splits a decoder layer, per model family: the one table that training and generation read.

Megatron-style (Shoeybi et al. 2019). In a layer's attention the q/k/v projections are split by output
features (column-parallel: each rank holds whole heads) and the output projection by input features
(row-parallel: each rank computes a partial sum, one all-reduce makes it whole); in the MLP gate/up are
column-parallel and down row-parallel, one all-reduce. Embeddings, norms and the LM head are not split.

A Hugging Face weight is (out, in): a column-parallel module splits its weight along dimension 0 and its
bias with it; a row-parallel module splits its weight along dimension 1 and keeps its bias whole (the
bias is added once, after the sum). The table holds names only, no parallelism code:

- engine/tensor_parallel builds the training plans from it (ColwiseParallel / RowwiseParallel, DTensor);
- the native engine slices each Hugging Face tensor by ``LayerSplit.shard_dim`` (rollout/native/parallel.py);
- the hybrid engine's switch checks the training shards against it (hybrid_engine/reshard.py).

Qwen2 and Mistral have Llama's layer: Qwen2's q/k/v biases are split with their columns, and Mistral's
sliding-window attention is per head, so it runs unchanged on a rank's local heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.models.adapters import LORA_A


@dataclass(frozen=True)
class LayerSplit:
    """The modules of a decoder layer (names relative to the layer) that tensor parallelism splits."""

    column: tuple[str, ...]
    """Split by output features: weight rows (dimension 0) and the bias."""
    row: tuple[str, ...]
    """Split by input features: weight columns (dimension 1); the bias stays whole."""
    experts: tuple[str, ...] = ()
    """A mixture's expert weights (E, out, in), split by expert (dimension 0): each rank runs its own experts on
    the tokens routed to them, and one all-reduce sums the experts' outputs as a row-parallel layer's. Their LoRA
    adapters travel whole (peft's layout interleaves the experts' B columns); the engine takes its experts' rows."""
    head_norms: tuple[str, ...] = ()
    """Norms over each head's features (Qwen3's q/k norms): whole on every rank, each rank normalising its own heads;
    training sums their weights' gradients over the ranks."""
    all_head_norms: tuple[str, ...] = ()
    """Norms over all of a projection's heads together (OLMoE's q/k norms): their weight split with the heads
    (dimension 0), the sums of squares summed over the ranks."""

    def shard_dim(self, name: str) -> int | None:
        """The dimension along which Hugging Face tensor ``name`` (or a LoRA adapter's ``<layer>.lora_A`` /
        ``.lora_B``, models/adapters.py) is split over tensor-parallel ranks (None: every rank holds it whole)."""
        if self.experts and name.endswith(self.experts):
            return 0
        module, _, kind = name.rpartition(".")
        if module.endswith(self.all_head_norms):  # weight (heads x head size,)
            return 0
        if module.endswith(self.column):  # weight (out, in), bias (out,), a LoRA B (out, r): split the outputs
            return None if kind == LORA_A else 0
        if module.endswith(self.row) and kind in ("weight", LORA_A):
            return 1  # weight (out, in), a LoRA A (r, in): split the inputs
        return None

    def is_row_bias(self, name: str) -> bool:
        """Whether ``name`` is the bias of a row-parallel module: whole on every rank, to be added once."""
        module, _, kind = name.rpartition(".")
        return kind == "bias" and module.endswith(self.row)


LLAMA = LayerSplit(
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
)
# a mixture of experts (Mixtral, Qwen3-MoE, OLMoE): attention as Llama's, the experts split between the ranks, the
# router whole
MIXTURE = LayerSplit(
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    row=("self_attn.o_proj",),
    experts=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
)
# Qwen3-MoE normalises each head's q and k on its own
QWEN3_MOE = LayerSplit(
    column=MIXTURE.column,
    row=MIXTURE.row,
    experts=MIXTURE.experts,
    head_norms=("self_attn.q_norm", "self_attn.k_norm"),
)
# OLMoE normalises all of q's heads together (and all of k's): each rank holds its heads' part of the norms' weights
OLMOE = LayerSplit(
    column=MIXTURE.column,
    row=MIXTURE.row,
    experts=MIXTURE.experts,
    all_head_norms=("self_attn.q_norm", "self_attn.k_norm"),
)
UNSPLIT = LayerSplit(column=(), row=())  # a layer on one rank: any family, nothing split
LAYER_SPLITS: dict[str, LayerSplit] = {
    "llama": LLAMA,
    "qwen2": LLAMA,
    "mistral": LLAMA,
    "mixtral": MIXTURE,
    "qwen3_moe": QWEN3_MOE,
    "olmoe": OLMOE,
}


def layer_split(model_type: str) -> LayerSplit:
    """The split of a family's decoder layer, by Hugging Face ``config.model_type``."""
    if model_type not in LAYER_SPLITS:
        raise ValueError(f"no tensor-parallel plan for model type '{model_type}'; plans: {', '.join(LAYER_SPLITS)}")
    return LAYER_SPLITS[model_type]
