"""Data: prompt datasets from parquet/jsonl, the batch loader, built-in tasks, preprocessing.

config = hybridflow.trainer.setup.config.default_config()   # or load_config(["data.max_prompt_length=512"])
dataset = RLHFDataset("data/arithmetic/train.parquet", tokenizer, config.data)
loader = PromptDataLoader(dataset, batch_size=32, seed=0)
for batch in loader: ...   # DataProto: input_ids, attention_mask, position_ids (B, P), left-padded
"""

from hybridflow.data.config import (
    DataConfig,
    DatasetConfig,
    PreferenceDataConfig,
    PreferenceDatasetConfig,
    SFTDataConfig,
    SFTDatasetConfig,
)
from hybridflow.data.dataset import RLHFDataset
from hybridflow.data.io import read_rows, write_rows
from hybridflow.data.loader import PromptDataLoader
from hybridflow.data.preference_dataset import PreferenceDataset
from hybridflow.data.sft_dataset import SFTDataset

__all__ = [
    "DataConfig",
    "DatasetConfig",
    "PreferenceDataConfig",
    "PreferenceDataset",
    "PreferenceDatasetConfig",
    "PromptDataLoader",
    "RLHFDataset",
    "SFTDataConfig",
    "SFTDataset",
    "SFTDatasetConfig",
    "read_rows",
    "write_rows",
]
