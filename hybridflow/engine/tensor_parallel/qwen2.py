"""Tensor-parallel plan of a Qwen2 decoder layer: Llama's layout; the q/k/v biases are split with
their columns (ColwiseParallel shards a bias along its output dimension)."""

from torch.distributed.tensor.parallel import ParallelStyle

from hybridflow.engine.tensor_parallel import llama


def decoder_layer_plan() -> dict[str, ParallelStyle]:
    return llama.decoder_layer_plan()
