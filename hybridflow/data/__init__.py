"""Data: prompt datasets from parquet/jsonl, the batch loader, built-in tasks, preprocessing.

dataset = RLHFDataset("data/arithmetic/train.parquet", tokenizer, DatasetConfig())
loader = PromptDataLoader(dataset, batch_size=32, seed=0)
for batch in loader: ...   # DataProto: input_ids, attention_mask, position_ids (B, P), left-padded
"""

from hybridflow.data.config import DatasetConfig
from hybridflow.data.dataset import RLHFDataset
from hybridflow.data.io import read_rows, write_rows
from hybridflow.data.loader import PromptDataLoader

__all__ = ["DatasetConfig", "PromptDataLoader", "RLHFDataset", "read_rows", "write_rows"]
