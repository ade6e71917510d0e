"""The Tinker API's protobuf messages in and out: a forward_backward request into plain arrays, and the results
the SDK reads as protobuf (forward_backward's outputs, sample's sequences) back to bytes.

The message classes are the pinned SDK's own (``tinker.proto``), so the wire format is the one its clients write
and read. A request that does not parse, or holds what the service cannot take (images, audio, tensors of the
wrong rank or dtype), raises ``BadRequest`` naming the datum and field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

try:
    from tinker.proto import tinker_public_pb2 as pb
except ImportError as error:  # the service's optional dependency
    raise ImportError("the training service needs the tinker SDK: pip install 'hybridflow[serve]'") from error

PROTOBUF = "application/x-protobuf"
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class BadRequest(ValueError):
    """A request the service cannot take: the client's mistake, answered with its reason."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    tokens: list[np.ndarray]  # each datum's model input (N,) int64
    inputs: list[dict[str, np.ndarray]]  # each datum's loss inputs, each (N,)


def _tensor(message: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(message.dtype)
    if dtype is None:
        raise BadRequest(f"{where}: dtype {pb.DType.Name(message.dtype)} is not float32 or int64")
    if message.HasField("sparse_csr"):
        raise BadRequest(f"{where}: sparse tensors are not taken; send a dense 1-D array of the datum's length")
    raw = message.dense
    if len(raw) % np.dtype(dtype).itemsize:
        raise BadRequest(f"{where}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values")
    array = np.frombuffer(raw, dtype=dtype)
    shape = list(message.shape) or [array.size]
    if len(shape) != 1 or shape[0] != array.size:
        raise BadRequest(f"{where}: shape {shape} with {array.size} values; a loss input is 1-D, one per token")
    return array


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A ``ForwardBackwardRequest`` (protobuf) as plain arrays."""
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as error:
        raise BadRequest(f"the body is not a ForwardBackwardRequest protobuf message ({error})") from None
    config: dict[str, float] = {key: float(value) for key, value in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise BadRequest(f"loss_fn_config {key!r}: text settings are not taken, only numbers")
        config[key] = float(value.number)
    tokens, inputs = [], []
    for index, datum in enumerate(request.data):
        parts = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise BadRequest(f"datum {index}: only text chunks are taken (this service serves a text model)")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise BadRequest(f"datum {index}: token bytes are not whole int32 values")
            parts.append(np.frombuffer(raw, dtype=np.int32))
        tokens.append(np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64))
        inputs.append({name: _tensor(t, f"datum {index} {name}") for name, t in datum.loss_fn_inputs.items()})
    return ForwardBackwardCall(
        model_id=request.model_id,
        seq_id=int(request.seq_id),
        loss_fn=request.loss_fn,
        loss_fn_config=config,
        forward_only=bool(request.forward_only),
        tokens=tokens,
        inputs=inputs,
    )


def _batched(arrays: Sequence[np.ndarray]) -> pb.BatchedTensor:
    """Per-datum float32 arrays as one BatchedTensor: the bytes end to end, with each datum's byte offsets."""
    data = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
    offsets = np.cumsum([0] + [a.nbytes for a in data]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in data), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def encode_forward_backward_output(fields: dict[str, Sequence[np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one record of per-datum float32 ``fields`` (logprobs, ...), and ``metrics``
    (keys ``name:reduction``)."""
    count = len(next(iter(fields.values()))) if fields else 0
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=count)
    for name, arrays in fields.items():
        record.fields[name].CopyFrom(_batched(arrays))
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    return message.SerializeToString()


@dataclass(frozen=True)
class EncodedSequence:
    tokens: Sequence[int]
    logprobs: Sequence[float]
    stop_reason: str  # "stop" | "length"


def encode_sample_response(sequences: Sequence[EncodedSequence], prompt_logprobs: Sequence[float] | None) -> bytes:
    """A ``SampleResponse``: each sequence's int32 tokens, float32 log-probs and stop reason; prompt log-probs with
    NaN where there is none (position 0)."""
    message = pb.SampleResponse()
    for sequence in sequences:
        message.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return message.SerializeToString()
