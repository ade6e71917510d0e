"""Tables of bench/grpo_step.py: per-stage seconds of each setting, best against best, and the doc page."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NOTES_MARKER = "<!-- Hand-written notes below this line are kept when --write-doc rewrites the page. -->"
TARGET = 3.0  # the goal: hybridflow at least this many times faster per step

# Stages common to both sides, in step order, with what each holds on either side.
STAGES = {
    "gen": "generation (hybridflow: incl. weight sync to the generation copy)",
    "reward": "reward (arithmetic scorer)",
    "old_log_prob": "old log-probs (a separate forward; both sides skip it when on-policy)",
    "prep": "advantages, padding, batching",
    "update": "actor update (forward + backward + AdamW)",
    "step": "whole step",
}


def hybridflow_stages(row: dict[str, float]) -> dict[str, float]:
    """One metrics.jsonl row as the common stages; `prep` is the advantage step plus what no timer covers."""
    stages = {
        "gen": row.get("timing_s/gen", 0.0),
        "reward": row.get("timing_s/reward", 0.0),
        "old_log_prob": row.get("timing_s/old_log_prob", 0.0),
        "update": row.get("timing_s/update_actor", 0.0),
        "step": row["timing_s/step"],
    }
    stages["prep"] = stages["step"] - sum(v for k, v in stages.items() if k != "step")
    return stages


@dataclass
class Measurement:
    system: str  # "hybridflow" | "TRL"
    setting: str
    steps: list[dict[str, float]]  # seconds per stage, one dict per step (the first is warm-up)
    response_length: list[float]  # mean new tokens per sample, one per step
    load: float  # 1-minute load average when the run started
    load_end: float = (
        0.0  # ... and when it ended (about 2 from the run itself on 2 cores; more: something else ran too)
    )
    versions: dict[str, str] = field(default_factory=dict)

    def mean(self, stage: str) -> float:
        return statistics.mean(step.get(stage, 0.0) for step in self.steps[1:])

    @property
    def measured_steps(self) -> int:
        return len(self.steps) - 1

    def spread(self) -> str:
        times = [step["step"] for step in self.steps[1:]]
        return f"{min(times):.1f}-{max(times):.1f}"

    def mean_length(self) -> float:
        return statistics.mean(self.response_length[1:] or self.response_length)


def best(measured: list[Measurement], system: str) -> Measurement | None:
    runs = [m for m in measured if m.system == system]
    return min(runs, key=lambda m: m.mean("step")) if runs else None


def _ratio(trl: float, hybridflow: float) -> str:
    """TRL / hybridflow, or "-" where a side spends under 0.05 s (no meaningful ratio)."""
    if min(trl, hybridflow) < 0.05:
        return "-"
    return f"{trl / hybridflow:.2f}x"


def comparison_table(hf: Measurement, trl: Measurement) -> list[str]:
    lines = [
        f"| seconds per step, mean of {hf.measured_steps} / {trl.measured_steps} steps "
        "| hybridflow | TRL | TRL / hybridflow |",
        "| --- | ---: | ---: | ---: |",
    ]
    for stage, label in STAGES.items():
        a, b = hf.mean(stage), trl.mean(stage)
        bold = "**" if stage == "step" else ""
        lines.append(
            f"| {bold}{label}{bold} | {bold}{a:.2f}{bold} | {bold}{b:.2f}{bold} | {bold}{_ratio(b, a)}{bold} |"
        )
    lines.append(f"| mean response length (tokens) | {hf.mean_length():.1f} | {trl.mean_length():.1f} | |")
    return lines


def settings_table(measured: list[Measurement]) -> list[str]:
    lines = [
        "| system | setting | step (s) | min-max | gen | old log-probs | update | resp. len | load start / end |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in measured:
        lines.append(
            f"| {m.system} | {m.setting} | {m.mean('step'):.2f} | {m.spread()} | {m.mean('gen'):.2f} | "
            f"{m.mean('old_log_prob'):.2f} | {m.mean('update'):.2f} | {m.mean_length():.1f} | "
            f"{m.load:.2f} / {m.load_end:.2f} |"
        )
    return lines


def verdict(hf: Measurement, trl: Measurement) -> str:
    ratio = trl.mean("step") / hf.mean("step")
    if ratio >= TARGET:
        return f"Target reached: hybridflow is {ratio:.2f}x faster per step than TRL (target {TARGET:.0f}x)."
    shares = ", ".join(f"{stage} {hf.mean(stage) / hf.mean('step'):.0%}" for stage in ("gen", "old_log_prob", "update"))
    return (
        f"Target NOT reached: TRL / hybridflow = {ratio:.2f}x per step (target {TARGET:.0f}x). "
        f"hybridflow's step splits as {shares}."
    )


def print_report(measured: list[Measurement]) -> None:
    print()
    print("\n".join(settings_table(measured)))
    hf, trl = best(measured, "hybridflow"), best(measured, "TRL")
    if hf and trl:
        print(f"\nbest against best: hybridflow [{hf.setting}] vs TRL [{trl.setting}]\n")
        print("\n".join(comparison_table(hf, trl)))
        print("\n" + verdict(hf, trl))


def _git_state(repo: Path) -> str:
    """The commit, and the hybridflow files changed on top of it (read-only git)."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    status = subprocess.run(
        ["git", "status", "--short", "hybridflow"], cwd=repo, capture_output=True, text=True
    ).stdout.split("\n")
    changed = [line[3:] for line in status if line.strip()]
    return f"commit {head or 'unknown'}" + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")


def save_results(path: Path, measured: list[Measurement]) -> None:
    path.write_text(json.dumps([dataclasses.asdict(m) for m in measured], indent=1))


def load_results(path: Path) -> list[Measurement]:
    return [Measurement(**row) for row in json.loads(path.read_text())]


def write_doc(path: Path, measured: list[Measurement], command: str, started: str, args) -> Path:
    hf, trl = best(measured, "hybridflow"), best(measured, "TRL")
    if not (hf and trl):
        raise SystemExit("--write-doc needs at least one hybridflow and one TRL measurement")
    versions = ", ".join(f"{k} {v}" for k, v in trl.versions.items())
    loads = ", ".join(f"{m.load:.2f} / {m.load_end:.2f}" for m in measured)
    text = f"""# Performance: one GRPO step, hybridflow against TRL

Written by `bench/grpo_step.py`; measured {started} to {time.strftime("%H:%M %Z")} on this machine
({platform.processor() or platform.machine()}, 2 cores, 24 GiB, no GPU) on {_git_state(path.parents[1])}.

    {command}

TRL side: {versions} (bench/.trl-venv). Load average (1 min) when each run started / ended, in the order of the
settings table: {loads} (the machine has 2 cores; a run itself adds about 2 by its end, so an end value well
above 2 means something else ran at the same time).

## Result (each side at its fastest setting)

hybridflow: {hf.setting}. TRL: {trl.setting}.

{chr(10).join(comparison_table(hf, trl))}

{verdict(hf, trl)}

## Every setting measured

{chr(10).join(settings_table(measured))}

## The workload (identical on both sides)

- Model: hybridflow's built-in `smollm2-135m-instruct` (SmolLM2-135M-Instruct), the same local Hugging Face
  directory for both; TRL loads it with `from_pretrained` (fp32 weights), offline.
- Data: the built-in arithmetic task (`python -m hybridflow.data.tasks arithmetic --train 64 --test 8 --seed 0`),
  chat-templated by each side with the model's template; reward = hybridflow's arithmetic scorer (TRL side:
  `hybridflow/reward/scorers/numbers.py` loaded by file path, `extract_final_number` copied).
- {args.prompts} prompts x {args.n} samples per step, at most {args.new_tokens} new tokens, temperature 1,
  no top-k / top-p, stop at EOS; GRPO advantages normalised by the group's std; clip 0.2;
  no KL (hybridflow `use_kl_loss=false`, `use_kl_in_reward=false`; TRL `beta=0`);
  AdamW lr {args.lr:g} constant, weight decay 0.01, grad-norm clip 1;
  one optimizer step per batch; no activation checkpointing (TRL's default `True` is turned off, as in hybridflow).
- Seconds per step: mean over steps 2..{args.steps} of each run (step 1 is warm-up and dropped). hybridflow: the
  trainer's own `timing_s/*` (metrics.jsonl). TRL: a `TrainerCallback` from `on_step_begin` to `on_step_end`,
  split by wrapping `GRPOTrainer._generate`, `_calculate_rewards`, `_get_per_token_logps_and_entropies` (no-grad
  calls) and `_generate_and_score_completions`; `update` is the rest of the step (forward, backward, clip, AdamW).
  Neither side counts fetching the batch of prompts or logging between steps.

## Differences that remain

- Neither side runs a separate old-log-prob forward: the step is on-policy (one optimizer step per batch), so
  both use the update's own log-probs, detached, as the old ones (hybridflow: `actor.reuse_update_log_probs`,
  on by default; with it off hybridflow runs `compute_log_prob`, about 0.5 s more per step here).
- hybridflow trains FSDP2-wrapped (fp32 master weights, bf16 compute) and generates with a bf16 copy of the
  weights; TRL's bf16 setting is autocast over fp32 weights, for generation too.
- The two sides sample different responses (different random streams), so the number of generated tokens differs
  a little; the mean response length is in the tables.
"""
    old = path.read_text() if path.exists() else ""
    notes = old.split(NOTES_MARKER, 1)[1] if NOTES_MARKER in old else "\n"
    path.write_text(text + "\n" + NOTES_MARKER + notes)
    return path
