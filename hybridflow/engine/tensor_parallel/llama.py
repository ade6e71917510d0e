"""Tensor-parallel plan of a Llama decoder layer (Megatron-style, Shoeybi et al. 2019).

Attention: q/k/v projections split by output columns (each rank holds whole heads), the output
projection by input rows, so one all-reduce per attention block. MLP: gate/up by columns,
down by rows, one all-reduce. The model code is untouched: Hugging Face's attention reshapes
with -1 heads, so it runs on the rank's local heads.
"""

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def decoder_layer_plan() -> dict[str, ParallelStyle]:
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
