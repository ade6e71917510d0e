"""The dataset's config (`data.*` keys)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DatasetConfig:
    """How rows become prompts; one line of help per field."""

    prompt_key: str = "prompt"  # column with the chat messages [{"role", "content"}, ...]
    max_prompt_length: int = 256  # longest templated prompt, in tokens (with the generation prompt)
    filter_overlong_prompts: bool = True  # True: drop longer prompts (logging the count); False: raise on the first

    def __post_init__(self) -> None:
        if self.max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length must be positive, got {self.max_prompt_length}")
        if not self.prompt_key:
            raise ValueError("data.prompt_key must name a column")
