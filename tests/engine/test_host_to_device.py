import numpy as np
import pytest
import torch

from morion.runner.forward_batch import build_forward_batch
from morion.runner.host_to_device import ToHost, to_device

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_arrays_of_mixed_dtypes_and_odd_sizes_arrive_intact(device):
    arrays = [
        np.arange(3, dtype=np.int64) - 2**40,  # beyond int32
        np.arange(5, dtype=np.int32).reshape(5) * -7,  # 20 bytes: the next array starts padded
        np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32),
        np.zeros(0, dtype=np.int64),
        np.array([0.5, -3.25], dtype=np.float32),
    ]
    tensors = to_device(arrays, device)
    for array, tensor in zip(arrays, tensors, strict=True):
        assert tensor.device.type == device.type and tuple(tensor.shape) == array.shape
        assert np.array_equal(tensor.cpu().numpy(), array)
        assert tensor.dtype == torch.from_numpy(array).dtype
        # Every view 16-byte aligned, whatever the sizes before it: Triton specializes kernels on it.
        assert tensor.data_ptr() % 16 == 0


def test_forward_batch_metadata():
    """Two sequences over pages of 4: a 3-token chunk from position 5 and a 1-token decode at 0."""
    batch = build_forward_batch(
        [([9, 8, 7, 6, 5, 4, 3, 2], [10, 11], 5, 3), ([42], [7], 0, 1)], [3, 1], 4, torch.device("cpu")
    )
    assert batch.input_ids.tolist() == [4, 3, 2, 42]
    assert batch.positions.tolist() == [5, 6, 7, 0]
    assert batch.out_slots.tolist() == [45, 46, 47, 28]
    assert batch.page_table.tolist() == [[10, 11], [7, 0]] and batch.page_table.dtype == torch.int32
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4] and batch.seq_lens.tolist() == [8, 1]
    assert batch.state_indices.tolist() == [3, 1]
    assert batch.query_ranges == [(0, 3), (3, 1)] and batch.last_rows == [2, 3] and batch.max_query_len == 3
    no_state = build_forward_batch([([1, 2], [0], 0, 2)], [None], 4, torch.device("cpu"))
    assert no_state.state_indices is None


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_values_on_their_way_to_the_host_are_those_at_the_copy(device):
    """The values read are the tensor's when the copy was queued, not after later writes to it."""
    tensor = torch.tensor([[1, 2], [3, 4]], device=device)
    copy = ToHost(tensor)
    tensor.fill_(0)
    assert copy.tolist() == [[1, 2], [3, 4]] and copy.tolist() is copy.tolist()
