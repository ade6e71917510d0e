"""The built-in tiny models: real HF directories, a sensible tokenizer, deterministic builds."""

import hashlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.models import TinyModelSpec, load_tokenizer, resolve_model_path, tiny_tokenizer
from hybridflow.models.tiny import build_tiny_model_dir

TINY = ["tiny-llama", "tiny-qwen2"]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_params(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, qwen2: bool) -> int:
    """Parameter count written out by hand: Llama has a separate lm_head; Qwen2 ties it and has q/k/v biases."""
    head_dim = h // heads
    attn = h * h + 2 * h * kv * head_dim + h * h  # q, k, v, o
    if qwen2:
        attn += h + 2 * kv * head_dim  # q, k, v biases
    layer = attn + 3 * h * inter + 2 * h  # SwiGLU MLP, two RMSNorms
    embeddings = vocab * h if qwen2 else 2 * vocab * h
    return embeddings + layers * layer + h  # + final norm


@pytest.mark.parametrize("name", TINY)
def test_builds_a_directory_that_transformers_loads(name):
    directory = resolve_model_path(name)
    assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)

    assert type(model).__name__ == {"tiny-llama": "LlamaForCausalLM", "tiny-qwen2": "Qwen2ForCausalLM"}[name]
    assert len(tokenizer) == model.config.vocab_size == 512
    assert n_params(model) == expected_params(64, 2, 4, 2, 128, 512, qwen2=name == "tiny-qwen2")
    assert n_params(model) == {"tiny-llama": 139_584, "tiny-qwen2": 107_072}[name]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (name == "tiny-qwen2")

    ids = tokenizer("What is 2+3?", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 512)


def test_special_tokens_and_padding():
    tokenizer = load_tokenizer("tiny-llama")
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["1+1=2", "12345+67890="], padding=True)
    assert batch.input_ids[0][:7] == [0] * 7  # 5 vs 12 tokens: 7 pads, on the left
    assert batch.attention_mask[0] == [0] * 7 + [1] * 5


def test_tokenizer_round_trips_text():
    tokenizer = load_tokenizer("tiny-qwen2")
    for text in ["What is 2+3? Answer: 5", "  two  spaces\nnew line\ttab", "héllo wörld ✓ 日本", "#### 1234567890"]:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text


def test_digits_are_one_token_each():
    tokenizer = load_tokenizer("tiny-llama")
    assert tokenizer.tokenize("12+7=19") == ["1", "2", "+", "7", "=", "1", "9"]
    assert tokenizer.tokenize("#### 2025") == ["####", "Ġ", "2", "0", "2", "5"]
    digit_ids = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digit_ids)) == 10
    assert tokenizer("9876543210", add_special_tokens=False).input_ids == digit_ids[::-1]


def test_chat_template_renders_chatml():
    tokenizer = load_tokenizer("tiny-llama")
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(chat[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt).input_ids
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> and <|im_end|> are single tokens


@torch.no_grad()
def test_batched_generation_with_left_padding():
    directory = resolve_model_path("tiny-llama")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(directory), load_tokenizer("tiny-llama")
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ["What is 2+3?", "Compute 12345 * 6789."]
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (2, batch.input_ids.shape[1] + 5)
    assert torch.equal(out[:, : batch.input_ids.shape[1]], batch.input_ids)


def test_build_is_deterministic(tmp_path):
    spec = TinyModelSpec()
    for name in ["a", "b"]:
        build_tiny_model_dir("tiny-llama", spec, tmp_path / name)
    build_tiny_model_dir("tiny-llama", TinyModelSpec(seed=1), tmp_path / "seed1")

    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in ["a", "b", "seed1"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_tokenizer_is_identical_in_another_process():
    """Hash seeds differ between processes; the trained vocab and merges must not."""
    code = (  # the module alone, by file path: importing the hybridflow package is slower
        "import hashlib, importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('tiny_tokenizer', sys.argv[1]); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(hashlib.sha256(module.build_tiny_tokenizer(512).backend_tokenizer.to_str().encode()).hexdigest())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, tiny_tokenizer.__file__], capture_output=True, text=True, check=True
    ).stdout.strip()
    here = hashlib.sha256(load_tokenizer("tiny-llama").backend_tokenizer.to_str().encode()).hexdigest()
    assert other == here


def test_overrides_give_a_different_model_in_its_own_directory():
    default = resolve_model_path("tiny-qwen2")
    sizes = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=48, vocab_size=300)  # fmt: skip
    other = resolve_model_path("tiny-qwen2", **sizes)
    assert other != default and default.exists()
    model = AutoModelForCausalLM.from_pretrained(other)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 3
    assert n_params(model) == expected_params(32, 3, 2, 1, 48, 300, qwen2=True)
    assert len(AutoTokenizer.from_pretrained(other)) == 300
    assert resolve_model_path("tiny-qwen2", **sizes) == other


def test_cached_model_is_reused_not_rebuilt():
    directory = resolve_model_path("tiny-llama")
    weights = directory / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model_path("tiny-llama") == directory
    assert weights.stat().st_mtime_ns == before


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_dim=8), "unknown tiny-model size override"),
        (dict(hidden_size=60, num_attention_heads=8), "must divide hidden_size"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "must divide num_attention_heads"),
        (dict(vocab_size=100), "vocab_size must be at least 259"),
    ],
)
def test_bad_overrides_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_model_path("tiny-llama", **overrides)


@pytest.mark.parametrize("name", TINY)
def test_the_config_without_building_is_the_built_directory_s(name, tmp_path, monkeypatch):
    """model_config reads a tiny model's config from its spec (the checks before a run use it), building nothing."""
    from transformers import AutoConfig

    from hybridflow.models import model_config

    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "empty"))
    unbuilt = model_config(name).to_dict()
    assert not (tmp_path / "empty").exists()
    monkeypatch.undo()
    built = AutoConfig.from_pretrained(resolve_model_path(name)).to_dict()
    differing = {key for key in built.keys() | unbuilt.keys() if built.get(key) != unbuilt.get(key)}
    assert differing <= {"_name_or_path", "architectures", "dtype"}  # what saving a model adds
    assert (unbuilt["pad_token_id"], unbuilt["eos_token_id"]) == (0, 2)
