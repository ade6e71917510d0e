"""The dataset's settings built by keyword, for tests (the values of the YAML's data section)."""

import dataclasses

from hybridflow.data import DatasetConfig

DATASET = DatasetConfig(prompt_key="prompt", max_prompt_length=256, filter_overlong_prompts=True)


def dataset_config(**changes) -> DatasetConfig:
    return dataclasses.replace(DATASET, **changes)
