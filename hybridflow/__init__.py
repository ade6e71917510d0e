"""hybridflow: RL post-training of language models with a single-controller driver over SPMD worker groups."""

from hybridflow.protocol import DataProto, DataProtoFuture

__all__ = ["DataProto", "DataProtoFuture"]
__version__ = "0.1.0"
