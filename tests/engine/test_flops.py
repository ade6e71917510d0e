"""FLOP counting against torch's own FLOP counter, the measured peak, and the MFU arithmetic."""

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from hybridflow.engine.flops import ModelFlops, flops_metrics, model_flops, peak_flops
from hybridflow.models import load_causal_lm


def test_forward_flops_by_hand_and_against_torch_flop_counter(tiny_path):
    model = load_causal_lm(tiny_path, dtype=torch.float32).eval()
    counts = model_flops(model)
    # tiny-llama: hidden 64, 2 layers, 4 heads of 16 (2 kv heads), MLP 128, vocab 512
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)
    assert counts.linear_weights == 2 * per_layer + 512 * 64
    assert counts.attention_width == 2 * 4 * 16
    assert counts.forward([3, 5]) == 2 * counts.linear_weights * 8 + 2 * 128 * (9 + 25)
    assert counts.training([3, 5]) == 3 * counts.forward([3, 5])
    assert counts.head_weights == 512 * 64
    # the LM head on 2 of the 8 tokens only (packed passes: the response tokens)
    assert counts.forward([3, 5], head_tokens=2) == counts.forward([3, 5]) - 2 * 512 * 64 * 6

    length = 24
    eager = load_causal_lm(tiny_path, dtype=torch.float32, attn_implementation="eager").eval()  # attention as matmuls
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        eager(input_ids=torch.randint(0, 512, (1, length)))
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert by_op["aten.mm"] == 2 * counts.linear_weights * length  # the linear layers
    # attention (QK^T and AV) as batched matmuls over the full square; the causal triangle is half
    assert by_op["aten.bmm"] / 2 == 2 * counts.attention_width * length**2
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        eager(input_ids=torch.randint(0, 512, (1, length)), logits_to_keep=torch.tensor([3, 7, 20]))
    mm = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}["aten.mm"]
    assert mm == counts.forward([length], head_tokens=3) - 2 * counts.attention_width * length**2


def test_peak_is_measured_once():
    first = peak_flops(torch.device("cpu"), seconds=0.2)
    start = time.perf_counter()
    assert peak_flops(torch.device("cpu"), seconds=0.2) == first  # cached: no second measurement
    assert time.perf_counter() - start < 0.05
    assert first > 1e9


def test_flops_metrics():
    metrics = flops_metrics("update", flops=6e12, seconds=2.0, peak=1e13)
    assert metrics == {"perf/tflops_update": 3.0, "perf/mfu_update": 0.3}


def test_a_tensor_parallel_rank_counts_its_share_of_the_layers_and_the_whole_head():
    flops = ModelFlops(linear_weights=1000, attention_width=64, head_weights=200)
    rank = flops.per_rank(2)
    assert rank == ModelFlops(linear_weights=600, attention_width=32, head_weights=200)  # (1000 - 200) / 2 + 200
    assert rank.forward([3]) == 2.0 * 600 * 3 + 2.0 * 32 * 9
    assert flops.per_rank(1) == flops
