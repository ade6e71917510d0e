"""The data section's config (`data.*` keys): how rows become prompts, and how prompts become batches."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.validation import require, require_choice, require_positive


@dataclass(kw_only=True)
class DatasetConfig:
    """What RLHFDataset reads: how rows become templated, tokenized prompts."""

    prompt_key: str  # column with the chat messages [{"role", "content"}, ...]
    max_prompt_length: int  # longest templated prompt, in tokens (with the generation prompt)
    filter_overlong_prompts: bool  # true: drop longer prompts (logging the count); false: stop at the first

    def __post_init__(self) -> None:
        require_positive(self.max_prompt_length, "max_prompt_length")
        require(bool(self.prompt_key), "prompt_key", "must name a column")


@dataclass(kw_only=True)
class DataConfig(DatasetConfig):
    """Prompts: the files, how rows become prompts (DatasetConfig's fields, inherited), batch sizes."""

    train_files: list[str]  # parquet/jsonl files of training prompts
    val_files: list[str]  # held-out prompts for validation (empty: no validation)
    train_batch_size: int  # prompts per training step (each sampled rollout.n times)
    val_batch_size: int  # prompts per validation generation call
    shuffle: bool  # shuffle training prompts each epoch (seeded by trainer.seed)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self.train_batch_size, "train_batch_size")
        require_positive(self.val_batch_size, "val_batch_size")


OVERLONG = ("error", "drop", "truncate")


@dataclass(kw_only=True)
class SFTDatasetConfig:
    """What SFTDataset reads: conversations or prompt/response pairs, and how long a sample may be."""

    messages_key: str  # column with a conversation [{"role", "content", "tool_calls"?}, ...] ("": none)
    prompt_key: str  # rows without a conversation: the prompt column (chat messages or text)
    response_key: str  # rows without a conversation: the answer column (text), all of it trained
    tools_key: str  # column with a row's tool schemas (OpenAI function format) for the chat template ("": none)
    max_length: int  # longest sample in tokens (the whole templated sequence)
    overlong: str  # a longer sample: error (stop, naming it) | drop (skip it, logging the count) | truncate (cut it)

    def __post_init__(self) -> None:
        require_positive(self.max_length, "max_length")
        require(bool(self.prompt_key), "prompt_key", "must name a column")
        require(bool(self.response_key), "response_key", "must name a column")
        require_choice(self.overlong, OVERLONG, "overlong")


@dataclass(kw_only=True)
class SFTDataConfig(SFTDatasetConfig):
    """Supervised data: the files, how rows become samples, batch sizes.

    How rows become samples: ``SFTDatasetConfig``'s fields, inherited."""

    train_files: list[str]  # parquet/jsonl files of training conversations (or prompt/response pairs)
    val_files: list[str]  # held-out files for the validation loss and perplexity (empty: no validation)
    train_batch_size: int  # samples per optimizer step, over all ranks (micro-batches accumulate gradients)
    val_batch_size: int  # samples per validation call
    shuffle: bool  # shuffle training samples each epoch (seeded by trainer.seed)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self.train_batch_size, "train_batch_size")
        require_positive(self.val_batch_size, "val_batch_size")


@dataclass(kw_only=True)
class PreferenceDatasetConfig:
    """What PreferenceDataset reads: a prompt with a chosen and a rejected answer per row."""

    prompt_key: str  # column with the prompt (chat messages or text); none: the answers' shared first messages
    chosen_key: str  # column with the preferred answer: text, or the assistant's (and tools') messages
    rejected_key: str  # column with the other answer, in the same form
    margin_key: str  # column with a number per pair for the reward model's margin ("": none)
    tools_key: str  # column with a row's tool schemas (OpenAI function format) for the chat template ("": none)
    max_length: int  # longest answer in tokens (the whole templated sequence)
    overlong: str  # a longer answer: error (stop, naming it) | drop (skip its pair, logging the count) | truncate

    def __post_init__(self) -> None:
        require_positive(self.max_length, "max_length")
        require(bool(self.chosen_key), "chosen_key", "must name a column")
        require(bool(self.rejected_key), "rejected_key", "must name a column")
        require(self.chosen_key != self.rejected_key, "rejected_key", "names the same column as chosen_key")
        require_choice(self.overlong, OVERLONG, "overlong")


@dataclass(kw_only=True)
class PreferenceDataConfig(PreferenceDatasetConfig):
    """Preference pairs: the files, how rows become pairs, batch sizes (in pairs).

    How rows become pairs: ``PreferenceDatasetConfig``'s fields, inherited."""

    train_files: list[str]  # parquet/jsonl files of training pairs
    val_files: list[str]  # held-out pairs for the validation loss and reward accuracy (empty: no validation)
    train_batch_size: int  # pairs per optimizer step, over all ranks (micro-batches accumulate gradients)
    val_batch_size: int  # pairs per validation call
    shuffle: bool  # shuffle training pairs each epoch (seeded by trainer.seed)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self.train_batch_size, "train_batch_size")
        require_positive(self.val_batch_size, "val_batch_size")
