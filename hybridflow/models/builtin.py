"""`model.path` → a local Hugging Face directory: built-in names or an existing directory.

hybridflow never downloads weights. A path is either one of the built-in names below,
which are materialised once into the cache (`$HYBRIDFLOW_CACHE`, default
`~/.cache/hybridflow`, under `models/`), or a local directory that transformers loads.
A built-in name wins over a relative directory of the same name; write `./tiny-llama`
to mean the directory.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from hybridflow.models import smollm2, tiny

_BUILTIN_DESCRIPTIONS = {
    "tiny-llama": "random-initialised tiny Llama with a byte-level BPE tokenizer, for tests",
    "tiny-qwen2": "random-initialised tiny Qwen2 (tied embeddings) with the same tokenizer, for tests",
    "tiny-qwen3-moe": "random-initialised tiny Qwen3-MoE (4 experts, 2 per token, tied embeddings), for tests",
    "tiny-olmoe": "random-initialised tiny OLMoE (4 experts, 2 per token) with the same tokenizer, for tests",
    "tiny-mixtral": "random-initialised tiny Mixtral (4 experts, 2 per token) with the same tokenizer, for tests",
    smollm2.NAME: f"pretrained SmolLM2-135M-Instruct, converted from the GGUF in `{smollm2.PACKAGE}`",
}


def list_builtin_models() -> dict[str, str]:
    """Built-in model names, each with one line on what it is."""
    return dict(_BUILTIN_DESCRIPTIONS)


def model_config(path: str | Path) -> PretrainedConfig:
    """The Hugging Face config of `path` without building or loading the model, for checks that need only its
    shape: a tiny model's from its spec, the pretrained built-in's from its GGUF file's header, a directory's
    `config.json`. FileNotFoundError as `resolve_model_path` gives it."""
    name = str(path)
    if name in tiny.TINY_FAMILIES:
        return tiny.tiny_model_config(name)
    if name == smollm2.NAME:
        return smollm2.header_config()
    return AutoConfig.from_pretrained(_local_model_dir(name), local_files_only=True)


def _local_model_dir(name: str) -> Path:
    """The existing local Hugging Face directory `name`; FileNotFoundError naming what would do instead."""
    directory = Path(name).expanduser()
    if directory.is_dir():
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{directory} is a directory but not a Hugging Face model: it has no config.json")
        return directory.resolve()
    builtins = ", ".join(sorted(_BUILTIN_DESCRIPTIONS))
    raise FileNotFoundError(
        f"model path {name!r} is neither a built-in model ({builtins}) nor an existing local directory. "
        "Expected a local Hugging Face directory (config.json, weights, tokenizer); hybridflow never "
        "downloads models, so fetch hub models beforehand (e.g. `huggingface-cli download ORG/NAME "
        "--local-dir DIR` on a machine with network) and pass DIR."
    )


def resolve_model_path(path: str | Path, **tiny_overrides: int) -> Path:
    """The local Hugging Face directory for `path`, building a built-in model on first use.

    `tiny_overrides` set the size of a `tiny-*` model (fields of `TinyModelSpec`, e.g.
    `hidden_size=128`); each size gets its own cache directory.
    """
    name = str(path)
    if name in tiny.TINY_FAMILIES:
        return tiny.materialise_tiny(name, **tiny_overrides)
    if tiny_overrides:
        raise ValueError(
            f"size overrides {sorted(tiny_overrides)} apply only to {sorted(tiny.TINY_FAMILIES)}, not {name!r}"
        )
    if name == smollm2.NAME:
        return smollm2.materialise_smollm2()
    return _local_model_dir(name)
