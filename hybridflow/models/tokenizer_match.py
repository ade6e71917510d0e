"""Whether two models share a tokenizer: what a teacher must share with its student for on-policy distillation.

The teacher scores the student's token ids in the student's rendering of the conversation, so the same id must
mean the same text to both (the vocabulary), the same special tokens must open and end turns, and the chat
template must render the context the teacher was trained on. Anything else (model sizes, padded embedding rows)
may differ, as long as the teacher's embedding covers every id.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from hybridflow.models.builtin import model_config, resolve_model_path

SHOWN = 3  # differing tokens named per difference


def _raw_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model_path(path), local_files_only=True)


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """Each named special token (bos, eos, pad, unk, ...) and each added special token, by its text."""
    named = {name: str(value) for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}
    added = {f"added:{token.content}": str(index) for index, token in tokenizer.added_tokens_decoder.items()}
    return named | added


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
    student_tok, teacher_tok = _raw_tokenizer(student), _raw_tokenizer(teacher)
    found = [
        _vocabulary_difference(student_tok.get_vocab(), teacher_tok.get_vocab()),
        _special_difference(_special_tokens(student_tok), _special_tokens(teacher_tok)),
    ]
    if student_tok.chat_template != teacher_tok.chat_template:
        found.append("chat template: the two render conversations differently")
    rows = model_config(teacher).vocab_size
    if rows < len(student_tok):
        found.append(f"the teacher's embedding has {rows} rows, fewer than the student's {len(student_tok)} tokens")
    return [difference for difference in found if difference]
