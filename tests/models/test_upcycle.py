"""Sparse upcycling (models/upcycle.py, ``hybridflow upcycle``): the mixture of experts computes the dense model's
logits at step 0 (fp32), its experts are copies of the dense MLP and its routers seeded; models it cannot copy into
Mixtral's layers and bad arguments are refused with the reason, exit 2."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.cli import main as cli
from hybridflow.models import load_causal_lm, resolve_model_path
from hybridflow.models.upcycle import upcycle, upcycled_config, upcycled_state


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("upcycle") / "tiny-moe"
    assert cli(["upcycle", "tiny-llama", str(out), "--experts", "4", "--top-k", "2"]) == 0
    return str(out)


def test_the_upcycled_model_answers_as_the_dense_one(upcycled):
    dense = load_causal_lm(str(resolve_model_path("tiny-llama")), dtype=torch.float32)
    moe = load_causal_lm(upcycled, dtype=torch.float32)
    assert moe.config.model_type == "mixtral" and moe.config.num_local_experts == 4
    ids = torch.randint(5, 500, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)
        _, _, chosen = moe.model.layers[0].mlp.gate(moe.model.embed_tokens(ids).reshape(-1, 64))
    assert chosen.unique().numel() > 2  # a random router spreads the tokens (a zero one would tie them)


def test_every_expert_is_the_dense_mlp_and_the_router_is_seeded(upcycled, tmp_path):
    dense = load_causal_lm(str(resolve_model_path("tiny-llama")), dtype=torch.float32).model.layers[1].mlp
    block = load_causal_lm(upcycled, dtype=torch.float32).model.layers[1].mlp  # saved in Mixtral's own format
    for expert in range(4):
        expected = torch.cat([dense.gate_proj.weight, dense.up_proj.weight])
        assert torch.equal(block.experts.gate_up_proj[expert], expected)
        assert torch.equal(block.experts.down_proj[expert], dense.down_proj.weight)
    path = resolve_model_path("tiny-llama")
    again = upcycle(path, tmp_path / "again", experts=4, top_k=2, seed=0)
    other = upcycle(path, tmp_path / "other", experts=4, top_k=2, seed=1)

    def router(directory) -> torch.Tensor:
        return load_causal_lm(str(directory), dtype=torch.float32).model.layers[1].mlp.gate.weight

    assert torch.equal(router(again), block.gate.weight)
    assert not torch.equal(router(other), block.gate.weight)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["tiny-qwen2", "{out}"], "dense llama or mistral model, not 'qwen2'"),
        (["tiny-qwen3-moe", "{out}"], "dense llama or mistral model, not 'qwen3_moe'"),
        (["tiny-llama", "{out}", "--experts", "2", "--top-k", "3"], "--top-k 3 must be 1 to --experts 2"),
    ],
)
def test_what_it_cannot_upcycle_exits_2_with_the_reason(arguments, message, tmp_path, capsys):
    assert cli(["upcycle", *(a.format(out=tmp_path / "out") for a in arguments)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_upcycled_smollm2_answers_as_smollm2():
    """The demo's model, 4 experts of which 2 per token, its tied head kept: the same logits at step 0 (fp32)."""
    dense = load_causal_lm("smollm2-135m-instruct", dtype=torch.float32)
    config = upcycled_config(dense.config, experts=4, top_k=2)
    moe = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    moe.load_state_dict(upcycled_state(dense.state_dict(), config, seed=0), strict=True)
    assert torch.equal(moe.lm_head.weight, dense.lm_head.weight)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=1e-4)
