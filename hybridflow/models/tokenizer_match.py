"""Whether two models share a tokenizer: what a teacher must share with its student for on-policy distillation.

The teacher scores the student's token ids in the student's rendering of the conversation, so the same id must
mean the same text to both (the vocabulary), the same special tokens must open and end turns, and the chat
template must render the context the teacher was trained on. Anything else (model sizes, padded embedding rows)
may differ, as long as the teacher's embedding covers every id.

What is compared is what decides the token ids, read from the model directories' files: the vocabulary, the
tokenizer's pipeline (tokenizer.json's model with its merges, normalizer, pre-tokenizer and added tokens), the
special tokens the files name (with their ids) and the chat template. Not the tokenizer class's defaults: two
models of different architectures with byte-identical tokenizer files share their tokenizer, though transformers
fills in class defaults (e.g. Qwen2's unk_token) for one and not the other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from hybridflow.models.builtin import model_config, resolve_model_path

SHOWN = 3  # differing tokens named per difference


def _raw_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model_path(path), local_files_only=True)


SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
PIPELINE = ("model", "normalizer", "pre_tokenizer", "added_tokens")  # the parts of tokenizer.json that make the ids


def _json_file(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _declared_special_tokens(directory: Path, vocabulary: dict[str, int]) -> dict[str, str]:
    """The special tokens the directory's files name (tokenizer_config.json, special_tokens_map.json), each with
    its id, and each added special token; none that a tokenizer class fills in by default."""
    declared: dict[str, str] = {}
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        settings = _json_file(directory / file)
        for name in SPECIAL_NAMES:
            value = settings.get(name)
            content = value.get("content") if isinstance(value, dict) else value
            if isinstance(content, str):
                declared[name] = f"{content} (id {vocabulary.get(content)})"
    return declared


def _special_tokens(tokenizer: PreTrainedTokenizerBase, directory: Path) -> dict[str, str]:
    """The named special tokens the files declare, and each added special token, by its text."""
    added = {
        f"added:{token.content}": str(index)
        for index, token in tokenizer.added_tokens_decoder.items()
        if getattr(token, "special", True)
    }
    return _declared_special_tokens(directory, tokenizer.get_vocab()) | added


def _pipeline_difference(student: Path, teacher: Path) -> str | None:
    """Which parts of tokenizer.json that make the ids differ (None when either directory has no tokenizer.json:
    the vocabulary and the special tokens are compared then)."""
    student_json, teacher_json = _json_file(student / "tokenizer.json"), _json_file(teacher / "tokenizer.json")
    if not student_json or not teacher_json:
        return None
    differing = [part for part in PIPELINE if student_json.get(part) != teacher_json.get(part)]
    if not differing:
        return None
    merges = student_json.get("model", {}).get("merges"), teacher_json.get("model", {}).get("merges")
    detail = " (other merges)" if "model" in differing and merges[0] != merges[1] else ""
    return f"tokenizer.json: its {', '.join(differing)} differ{detail}"


def _vocabulary_difference(student: dict[str, int], teacher: dict[str, int]) -> str | None:
    if student == teacher:
        return None
    only_student = sorted(set(student) - set(teacher))[:SHOWN]
    only_teacher = sorted(set(teacher) - set(student))[:SHOWN]
    moved = sorted(t for t in set(student) & set(teacher) if student[t] != teacher[t])[:SHOWN]
    parts = [f"{len(student)} tokens against {len(teacher)}"]
    if only_student:
        parts.append(f"only the student's: {only_student}")
    if only_teacher:
        parts.append(f"only the teacher's: {only_teacher}")
    if moved:
        parts.append(f"other ids for {moved}")
    return "vocabulary: " + "; ".join(parts)


def _special_difference(student: dict[str, str], teacher: dict[str, str]) -> str | None:
    differing = sorted(k for k in set(student) | set(teacher) if student.get(k) != teacher.get(k))
    if not differing:
        return None
    shown = ", ".join(f"{k}: {student.get(k)!r} against {teacher.get(k)!r}" for k in differing[:SHOWN])
    return f"special tokens ({len(differing)} differ): {shown}"


def tokenizer_differences(student: str | Path, teacher: str | Path) -> list[str]:
    """What differs between the tokenizers of the models ``student`` and ``teacher`` (built-in names or model
    directories): vocabulary, special tokens, chat template, and whether the teacher's embedding covers the
    student's ids; empty when the teacher can score the student's tokens."""
    student_dir, teacher_dir = Path(resolve_model_path(student)), Path(resolve_model_path(teacher))
    student_tok, teacher_tok = _raw_tokenizer(student_dir), _raw_tokenizer(teacher_dir)
    vocabulary = _vocabulary_difference(student_tok.get_vocab(), teacher_tok.get_vocab())
    found = [
        vocabulary,
        None if vocabulary else _pipeline_difference(student_dir, teacher_dir),
        _special_difference(_special_tokens(student_tok, student_dir), _special_tokens(teacher_tok, teacher_dir)),
    ]
    if student_tok.chat_template != teacher_tok.chat_template:
        found.append("chat template: the two render conversations differently")
    rows = model_config(teacher).vocab_size
    if rows < len(student_tok):
        found.append(f"the teacher's embedding has {rows} rows, fewer than the student's {len(student_tok)} tokens")
    return [difference for difference in found if difference]
