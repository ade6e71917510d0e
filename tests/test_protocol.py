import pickle

import numpy as np
import pytest
import torch

from hybridflow.batch_keys import METRICS
from hybridflow.protocol import DataProto, DataProtoFuture, DataProtoItem, concat_and_unpad


def make(n: int = 4) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n * 2).view(n, 2), "y": torch.arange(n, dtype=torch.float32) * 10},
        {"name": [f"s{i}" for i in range(n)]},
        {"temperature": 1.0},
    )


def names(data: DataProto) -> list:
    return data.non_tensor_batch["name"].tolist()


def test_from_dict_len_and_types():
    data = make(3)
    assert len(data) == 3
    assert data.batch["x"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert data.non_tensor_batch["name"].dtype == object
    assert data.meta_info == {"temperature": 1.0}


def test_from_single_dict_splits_by_type():
    data = DataProto.from_single_dict({"a": torch.ones(2), "b": ["p", "q"]}, meta_info={"k": 1})
    assert list(data.batch.keys()) == ["a"] and names_of(data) == ["b"]


def names_of(data: DataProto) -> list:
    return sorted(data.non_tensor_batch)


def test_non_tensor_only_batch_has_length():
    data = DataProto.from_dict(non_tensors={"a": ["x", "y", "z"]})
    assert len(data) == 3 and data.batch is None
    assert names(DataProto.from_dict(non_tensors={"name": ["a", "b"]})[[1]]) == ["b"]


@pytest.mark.parametrize(
    "tensors, non_tensors, message",
    [
        ({"a": torch.ones(3), "b": torch.ones(2)}, {}, "tensor key 'b' has 2 rows"),
        ({"a": torch.ones(3)}, {"n": ["x", "y"]}, "non-tensor key 'n' has length 2"),
        ({"a": [1, 2, 3]}, {}, "tensor key 'a' must be a torch.Tensor"),
        ({"a": torch.tensor(1.0)}, {}, "tensor key 'a' is a scalar"),
        ({}, {"n": torch.ones(2)}, "non-tensor key 'n' got a torch.Tensor"),
        ({}, {"n": "abc"}, "non-tensor key 'n' must be a numpy array or a list"),
    ],
)
def test_bad_input_names_the_key(tensors, non_tensors, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DataProto.from_dict(tensors, non_tensors)


def test_index_int_slice_list_mask():
    data = make(4)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["x"].tolist() == [4, 5] and item.non_tensor_batch["name"] == "s2"
    assert names(data[1:3]) == ["s1", "s2"] and data[1:3].batch["y"].tolist() == [10.0, 20.0]
    assert names(data[[3, 0]]) == ["s3", "s0"] and data[[3, 0]].batch["x"].tolist() == [[6, 7], [0, 1]]
    assert names(data[np.array([True, False, True, False])]) == ["s0", "s2"]
    assert names(data[torch.tensor([1])]) == ["s1"]
    with pytest.raises(IndexError):
        data[4]


def test_select_and_pop():
    data = make(2)
    only_x = data.select(batch_keys=["x"], non_tensor_batch_keys=[], meta_info_keys=[])
    assert list(only_x.batch.keys()) == ["x"] and only_x.non_tensor_batch == {} and only_x.meta_info == {}
    with pytest.raises(KeyError, match="'missing'"):
        data.select(batch_keys=["missing"])
    popped = data.pop(batch_keys=["y"], non_tensor_batch_keys=["name"], meta_info_keys=["temperature"])
    assert list(popped.batch.keys()) == ["y"] and popped.batch["y"].tolist() == [0.0, 10.0]
    assert names(popped) == ["s0", "s1"] and popped.meta_info == {"temperature": 1.0}
    assert list(data.batch.keys()) == ["x"] and data.non_tensor_batch == {} and data.meta_info == {}


def test_select_deepcopy_is_independent():
    data = make(2)
    copy = data.select(deepcopy=True)
    copy.batch["y"][0] = 99.0
    assert data.batch["y"][0] == 0.0


def test_rename():
    data = make(2).rename(["x", "y"], ["input_ids", "score"])
    assert sorted(data.batch.keys()) == ["input_ids", "score"]
    assert data.batch["score"].tolist() == [0.0, 10.0]
    with pytest.raises(ValueError, match="2 old keys but 1 new"):
        data.rename(["input_ids", "score"], ["a"])


def test_union_merges_and_rejects_conflicts():
    left = make(2)
    right = DataProto.from_dict(
        {"z": torch.tensor([1, 2]), "x": torch.arange(4).view(2, 2)}, {"tag": ["a", "b"]}, {"step": 3}
    )
    left.union(right)
    assert sorted(left.batch.keys()) == ["x", "y", "z"] and sorted(left.non_tensor_batch) == ["name", "tag"]
    assert left.meta_info == {"temperature": 1.0, "step": 3}
    with pytest.raises(ValueError, match="tensor key 'x'"):
        make(2).union(DataProto.from_dict({"x": torch.zeros(2, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match="non-tensor key 'name'"):
        make(2).union(DataProto.from_dict(non_tensors={"name": ["s0", "other"]}))
    with pytest.raises(ValueError, match="meta_info key 'temperature'"):
        make(2).union(DataProto.from_dict(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="different lengths \\(2 and 3\\)"):
        make(2).union(make(3))


def test_chunk_split_concat():
    data = make(6)
    chunks = data.chunk(3)
    assert [names(c) for c in chunks] == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"]]
    assert [len(p) for p in data.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="cannot chunk 6 rows into 4"):
        data.chunk(4)
    joined = DataProto.concat(chunks)
    assert names(joined) == names(data) and torch.equal(joined.batch["x"], data.batch["x"])
    with pytest.raises(ValueError, match="different non-tensor keys"):
        DataProto.concat(
            [make(1), DataProto.from_dict({"x": torch.zeros(1, 2, dtype=torch.long), "y": torch.zeros(1)})]
        )


def test_repeat_interleaved_and_tiled():
    data = make(2)
    assert names(data.repeat(3)) == ["s0", "s0", "s0", "s1", "s1", "s1"]
    assert data.repeat(3).batch["y"].tolist() == [0.0, 0.0, 0.0, 10.0, 10.0, 10.0]
    assert names(data.repeat(2, interleave=False)) == ["s0", "s1", "s0", "s1"]
    assert data.repeat(2, interleave=False).batch["x"].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_reorder_in_place():
    data = make(3)
    data.reorder(torch.tensor([2, 0, 1]))
    assert names(data) == ["s2", "s0", "s1"] and data.batch["y"].tolist() == [20.0, 0.0, 10.0]


def test_pad_to_divisor_and_unpad():
    data = make(5)
    padded, pad = data.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert names(padded) == ["s0", "s1", "s2", "s3", "s4", "s0", "s1", "s2"]
    assert names(padded.unpad(pad)) == names(data)
    same, zero = data.pad_to_divisor(5)
    assert zero == 0 and same is data
    tiny, pad = make(1).pad_to_divisor(3)
    assert pad == 2 and names(tiny) == ["s0", "s0", "s0"]


def test_to_device():
    data = make(2).to("cpu")
    assert data.batch["x"].device.type == "cpu"


def test_pickle_and_disk_round_trip(tmp_path):
    data = make(3)
    data.batch.set("h", torch.randn(3, 4, dtype=torch.bfloat16))
    for restored in (pickle.loads(pickle.dumps(data)), _disk(data, tmp_path / "batch.pkl")):
        assert sorted(restored.batch.keys()) == ["h", "x", "y"]
        assert torch.equal(restored.batch["h"], data.batch["h"]) and restored.batch["h"].dtype == torch.bfloat16
        assert names(restored) == names(data) and restored.meta_info == data.meta_info


def _disk(data: DataProto, path) -> DataProto:
    data.save_to_disk(path)
    return DataProto.load_from_disk(path)


def test_pickle_of_a_view_carries_only_its_rows():
    big = DataProto.from_dict({"x": torch.zeros(10_000, 64)})
    view = big[:10]
    assert len(pickle.dumps(view)) < 20_000


def test_iterator_epochs_and_seeded_shuffle():
    data = make(4)
    plain = [names(b) for b in data.make_iterator(mini_batch_size=2, epochs=2)]
    assert plain == [["s0", "s1"], ["s2", "s3"], ["s0", "s1"], ["s2", "s3"]]
    first = [names(b) for b in data.make_iterator(2, epochs=2, shuffle=True, seed=7)]
    again = [names(b) for b in data.make_iterator(2, epochs=2, shuffle=True, seed=7)]
    assert first == again
    for epoch in (first[:2], first[2:]):
        assert sorted(sum(epoch, [])) == ["s0", "s1", "s2", "s3"]
    with pytest.raises(ValueError, match="does not divide"):
        next(data.make_iterator(3))


def test_future_chunks_resolve_like_the_collected_data():
    parts = [make(4)[:2], make(4)[2:]]
    future = DataProtoFuture(collect_fn=concat_and_unpad, futures=[])
    future.futures = []
    collected = concat_and_unpad(parts)
    assert names(collected) == ["s0", "s1", "s2", "s3"]
    chunk = future.chunk(2)[1]
    assert names(chunk.dispatch_fn(collected)) == ["s2", "s3"]
    with pytest.raises(ValueError, match="already one chunk"):
        chunk.chunk(2)


def test_collected_rank_outputs_average_their_metrics():
    ranks = [
        DataProto.from_dict({"x": torch.tensor([1.0, 2.0])}, meta_info={METRICS: {"loss": 1.0, "only_rank0": 5.0}}),
        DataProto.from_dict({"x": torch.tensor([3.0, 4.0])}, meta_info={METRICS: {"loss": 3.0}}),
    ]
    collected = concat_and_unpad(ranks, pad_size=1)  # the last row was padding
    assert collected.batch["x"].tolist() == [1.0, 2.0, 3.0]
    assert collected.meta_info[METRICS] == {"loss": 2.0, "only_rank0": 5.0}
    assert ranks[0].meta_info[METRICS] == {"loss": 1.0, "only_rank0": 5.0}  # the ranks' own dicts untouched
