"""Tensor-parallel plan of a Mistral decoder layer: Llama's layout (same projections, no biases;
sliding-window attention is per head, so it runs unchanged on a rank's local heads)."""

from torch.distributed.tensor.parallel import ParallelStyle

from hybridflow.engine.tensor_parallel import llama


def decoder_layer_plan() -> dict[str, ParallelStyle]:
    return llama.decoder_layer_plan()
