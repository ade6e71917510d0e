"""The protobuf messages against the SDK's own encoder and decoder: a request the SDK writes decodes to its
arrays, and the results the service writes decode in the SDK to the same numbers."""

import math

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from hybridflow.serve.wire import (
    BadRequest,
    EncodedSequence,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def test_a_request_the_sdk_writes_decodes_to_its_arrays():
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": np.array([0.0, 1.0, 0.5], np.float32)},
        ),
        types.Datum(
            model_input=types.ModelInput(
                chunks=[types.EncodedTextChunk(tokens=[7]), types.EncodedTextChunk(tokens=[8])]
            ),
            loss_fn_inputs={"target_tokens": np.array([8, 9]), "weights": np.array([1.0, 1.0], np.float32)},
        ),
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config={"clip_high_threshold": 1.3}
        ),
        model_id="s:train:0",
        seq_id=4,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    call = decode_forward_backward(message.SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 4, "ppo", True)
    assert call.loss_fn_config == pytest.approx({"clip_high_threshold": 1.3})
    assert [t.tolist() for t in call.tokens] == [[1, 2, 3], [7, 8]]
    assert call.inputs[0]["weights"].tolist() == [0.0, 1.0, 0.5] and call.inputs[1]["target_tokens"].tolist() == [8, 9]
    with pytest.raises(BadRequest, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")


def test_results_decode_in_the_sdk():
    fields = {
        "logprobs": [np.array([-1.0, -2.0]), np.array([-0.5])],
        "elementwise_loss": [np.array([1.0, 2.0]), np.array([0.5])],
    }
    output = deserialize_forward_backward_output(encode_forward_backward_output(fields, {"loss:sum": 3.5}))
    assert output.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in output.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert output.loss_fn_outputs[1]["elementwise_loss"].tolist() == [0.5]
    sequences = [EncodedSequence([4, 5], [-0.25, -0.5], "stop"), EncodedSequence([6], [-1.0], "length")]
    response = deserialize_sample_response(encode_sample_response(sequences, [math.nan, -2.0, -3.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([4, 5], [-0.25, -0.5], "stop"),
        ([6], [-1.0], "length"),
    ]
    assert response.prompt_logprobs == [None, -2.0, -3.0]
