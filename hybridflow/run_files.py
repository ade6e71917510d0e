"""A run directory's format: its files' names and the records in them, defined once for what writes them
(the trainer, the workers' checkpoints) and what reads them (``hybridflow report``, ``export``, a resume).

    <run_dir>/config.yaml         the run's whole config (trainer/setup/config.py ``to_yaml``)
    <run_dir>/metrics.jsonl       one JSON object per step: {"step": 3, "<metric>": value, ...}
    <run_dir>/timeline.jsonl      one JSON object per span of work (``Span``)
    <run_dir>/global_step_N/      a checkpoint (trainer/services/checkpoint.py): actor/ and critic/ training state,
                                  actor/huggingface/ the model's config and tokenizer for export

metrics.jsonl and timeline.jsonl are appended to as the run goes; a resumed run drops the records of
the steps after its checkpoint (it redoes them). A line a killed run left unfinished is skipped by
the readers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TIMELINE_FILE = "timeline.jsonl"
TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"  # fully_async: per step, the dataset index and version of each group
ACTOR_STATE = "actor"  # a checkpoint's actor: sharded training state (engine/checkpoint.py)
CRITIC_STATE = "critic"  # a checkpoint's critic, when the run has one
HF_FILES = "huggingface"  # inside ACTOR_STATE: the model's config, generation config and tokenizer
ADAPTER_FILES = "adapter"  # beside HF_FILES in a LoRA role's state: peft's adapter_config.json


@dataclass(frozen=True)
class Span:
    """One stage on one worker (or the driver) in one step; times in seconds since that step began.

    ``lane`` is a resource pool's name, or ``driver`` (rank -1) for the driver's own stages."""

    step: int
    lane: str
    stage: str
    rank: int
    start: float
    end: float


def append_spans(path: Path, spans: Iterable[Span]) -> None:
    with Path(path).open("a") as out:
        for span in spans:
            out.write(json.dumps(asdict(span)) + "\n")


def read_spans(path: Path) -> list[Span]:
    """Every span in ``path``; ValueError naming the file and line for one that is not a span.

    An unfinished last line (no newline: the run was killed mid-write) is skipped, so a crashed run still
    gets its report; a bad line anywhere else means a bad writer and raises.
    """
    text = Path(path).read_text()
    lines = text.splitlines()
    spans = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            spans.append(
                Span(
                    step=int(record["step"]),
                    lane=str(record["lane"]),
                    stage=str(record["stage"]),
                    rank=int(record["rank"]),
                    start=float(record["start"]),
                    end=float(record["end"]),
                )
            )
        except (ValueError, KeyError, TypeError) as error:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a timeline span ({error}): {line[:120]}") from None
    return spans


def append_metrics(path: Path, step: int, metrics: dict[str, float | str]) -> None:
    """One metrics.jsonl record."""
    with Path(path).open("a") as out:
        out.write(json.dumps({"step": step, **metrics}) + "\n")


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return None  # an unfinished line of a killed run


def keep_records_up_to(path: Path, step: int) -> int:
    """Drop the records (metrics or spans) of steps after ``step``, and unfinished lines; returns how many
    lines were dropped."""
    lines = Path(path).read_text().splitlines()
    kept = [line for line in lines if (line_step := _step_of(line)) is not None and line_step <= step]
    Path(path).write_text("".join(line + "\n" for line in kept))
    return len(lines) - len(kept)
