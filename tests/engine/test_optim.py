import math

import pytest
import torch

from hybridflow.engine.optim import OptimConfig, build_optimizer, init_adamw_state, lr_multiplier

ADAMW = {"lr": 1e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}


def test_warmup_then_constant():
    config = OptimConfig(**ADAMW, lr_warmup_steps=4, lr_scheduler="constant", min_lr_ratio=0.0)
    assert [lr_multiplier(s, config, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_then_cosine_to_min_ratio():
    config = OptimConfig(**ADAMW, lr_warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    # after warm-up, progress p = (step - 2) / (10 - 2); multiplier = 0.1 + 0.9 * (1 + cos(pi p)) / 2
    assert lr_multiplier(2, config, 10) == pytest.approx(1.0)
    assert lr_multiplier(6, config, 10) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(10, config, 10) == pytest.approx(0.1)
    assert lr_multiplier(4, config, 10) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_made_before_the_first_step_gives_torch_s_steps(fused, amsgrad):
    """init_adamw_state makes at once the state torch makes at the first step: three steps from it give the same
    parameters and state, bit for bit, as three steps of an optimizer left to make its own."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    runs = []
    for eager in (False, True):
        params = [p.clone().requires_grad_() for p in start]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, fused=fused or None)
        if eager:
            init_adamw_state(optimizer)
            assert all(optimizer.state[p]["step"] == 0 for p in params)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            optimizer.step()
        runs.append((params, optimizer))
    (lazy, lazy_opt), (eager, eager_opt) = runs
    for a, b in zip(lazy, eager, strict=True):
        assert torch.equal(a, b)
        assert lazy_opt.state[a].keys() == eager_opt.state[b].keys()
        for key, value in lazy_opt.state[a].items():
            other = eager_opt.state[b][key]
            assert torch.equal(value, other) and value.dtype == other.dtype and value.device == other.device, key


def test_build_optimizer_makes_the_state_at_once():
    model = torch.nn.Linear(4, 2)
    config = OptimConfig(**ADAMW, lr_warmup_steps=0, lr_scheduler="constant", min_lr_ratio=0.0)
    optimizer = build_optimizer(model, config)
    assert {key for p in model.parameters() for key in optimizer.state[p]} == {"step", "exp_avg", "exp_avg_sq"}
