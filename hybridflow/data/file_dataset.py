"""What the supervised data sets share (data/sft_dataset.py, data/preference_dataset.py, data/reward_pairs.py): rows
read whole from parquet/jsonl files and tokenised once, up front, by a tokenizer with a pad token (``collate`` pads
the RL step's layout with it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from hybridflow.data.io import data_files
from hybridflow.data.token_rows import SampleEncoder

ConfigT = TypeVar("ConfigT")


class FileDataset(Generic[ConfigT]):
    """A data set of ``files``, read and tokenised on construction by the subclass's ``_load``."""

    unit: ClassVar[str]  # what one item is, in messages

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        config: ConfigT,
        *,
        generation_eos: int | list[int] | None = None,
        key: str = "data.train_files",
    ) -> None:
        """generation_eos: the model's generation EOS (its generation_config), a stop token besides the tokenizer's.
        key: the setting that named ``files`` (errors name it, the file and the row)."""
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; collate needs one")
        self.tokenizer = tokenizer
        self.config = config
        self.files = data_files(files, key)
        self._load(key, generation_eos)

    def _load(self, key: str, generation_eos: int | list[int] | None) -> None:
        """Read and tokenise ``self.files`` (``key``: the setting that named them, for errors)."""
        raise NotImplementedError

    def sample_encoder(self, generation_eos: int | list[int] | None) -> SampleEncoder:
        """Chat samples to token rows within the config's ``max_length``, longer ones as its ``overlong`` says."""
        config: Any = self.config
        return SampleEncoder(
            self.tokenizer, max_length=config.max_length, overlong=config.overlong, generation_eos=generation_eos
        )
