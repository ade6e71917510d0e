"""A GGUF file's metadata and tensor names, read from its header alone (the tensors are not touched).

The config checks of a run need a model's shape (heads, layers, widths) before any model is converted:
`gguf.GGUFReader` maps the whole file and builds an array per metadata field (2-3 s for SmolLM2's file,
whose tokenizer is 49k strings), and transformers' GGUF config loading uses it. This reads the header's
key-value pairs and tensor names in one pass (tens of milliseconds). The layout (GGUF v2/v3, little-endian):
magic ``GGUF``, version (u32), tensor count (u64), key-value count (u64), the key-value pairs (a string key, a
u32 value type, the value), then per tensor its name, dimensions, type and offset.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# value types of the GGUF spec: id -> struct format (scalars); 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself: its metadata (arrays longer than ``max_array`` as their length) and
    the names of its tensors."""

    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]


def _read(handle: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(handle: BinaryIO) -> str:
    length = _read(handle, "<Q")
    return handle.read(length).decode("utf-8", errors="replace")


def _value(handle: BinaryIO, kind: int, max_array: int) -> Any:
    if kind in _SCALARS:
        return _read(handle, _SCALARS[kind])
    if kind == _STRING:
        return _string(handle)
    if kind == _ARRAY:
        item_kind, count = _read(handle, "<I"), _read(handle, "<Q")
        if item_kind in _SCALARS and count > max_array:  # skip it: only its length is kept
            handle.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
            return count
        items = [_value(handle, item_kind, max_array) for _ in range(count)]
        return items if count <= max_array else count
    raise ValueError(f"unknown GGUF value type {kind}")


def read_gguf_header(path: str | Path, max_array: int = 64) -> GGUFHeader:
    """The metadata and tensor names of the GGUF file ``path``; ValueError when it is not one."""
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version = _read(handle, "<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        tensors, pairs = _read(handle, "<Q"), _read(handle, "<Q")
        metadata = {}
        for _ in range(pairs):
            key = _string(handle)
            metadata[key] = _value(handle, _read(handle, "<I"), max_array)
        names = []
        for _ in range(tensors):
            names.append(_string(handle))
            dims = _read(handle, "<I")
            handle.seek(8 * dims + 4 + 8, 1)  # the dimensions (u64 each), the type (u32), the offset (u64)
    return GGUFHeader(metadata=metadata, tensor_names=tuple(names))


# Hugging Face LlamaConfig fields from a llama GGUF's metadata (as transformers' GGUF loader maps them)
_LLAMA_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "llama.block_count": ("num_hidden_layers", int),
    "llama.context_length": ("max_position_embeddings", int),
    "llama.embedding_length": ("hidden_size", int),
    "llama.feed_forward_length": ("intermediate_size", int),
    "llama.attention.head_count": ("num_attention_heads", int),
    "llama.attention.head_count_kv": ("num_key_value_heads", int),
    "llama.rope.freq_base": ("rope_theta", float),
    "llama.attention.layer_norm_rms_epsilon": ("rms_norm_eps", float),
    "llama.vocab_size": ("vocab_size", int),
    "tokenizer.ggml.bos_token_id": ("bos_token_id", int),
    "tokenizer.ggml.eos_token_id": ("eos_token_id", int),
    "tokenizer.ggml.unknown_token_id": ("unk_token_id", int),
}


def llama_config_fields(header: GGUFHeader) -> dict[str, Any]:
    """The LlamaConfig keyword arguments a llama-architecture GGUF header gives (the shape, RoPE, the special
    tokens; the embedding is tied when the file has no separate ``output.weight``)."""
    architecture = header.metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"expected a llama-architecture GGUF, got {architecture!r}")
    fields = {name: cast(header.metadata[key]) for key, (name, cast) in _LLAMA_FIELDS.items() if key in header.metadata}
    if "vocab_size" not in fields and isinstance(header.metadata.get("tokenizer.ggml.tokens"), int):
        fields["vocab_size"] = header.metadata["tokenizer.ggml.tokens"]  # the token list's length
    fields["tie_word_embeddings"] = "output.weight" not in header.tensor_names
    return fields
