"""StepInputs: a step's integer tensors as views of persistent buffers, uploaded at once. On the
CPU the copying path (separate "device" buffers, unpinned) runs as on CUDA, apart from the
pinned memory and the event."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.attention import BatchLayout
from tokenmill.layers.step_inputs import StepInputs


def test_cpu_hands_out_views_of_one_buffer_per_dtype_filled_at_once():
    inputs = StepInputs("cpu")
    assert not inputs.copy and not inputs.pin
    ids, pos = inputs.longs([5, 6, 7]), inputs.longs(range(10, 13))
    lens, table = inputs.ints([3, 1]), inputs.table([[4, 5, 6], [7]])
    assert ids.tolist() == [5, 6, 7] and pos.tolist() == [10, 11, 12]  # before any upload
    assert ids.dtype == torch.long and lens.dtype == table.dtype == torch.int32
    assert table.tolist() == [[4, 5, 6], [7, 0, 0]]  # padded with block 0
    assert ids.untyped_storage().data_ptr() == pos.untyped_storage().data_ptr()
    assert lens.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    inputs.upload()
    storage = ids.untyped_storage().data_ptr()
    assert inputs.longs([1]).untyped_storage().data_ptr() == storage  # the next step reuses the buffer


def test_copying_path_fills_the_device_views_at_upload_and_reuses_its_buffers():
    inputs = StepInputs("cpu", copy=True, pin=False)
    ids, lens = inputs.longs([1, 2, 3]), inputs.ints([9])
    tables = inputs.table([[1, 2], [3, 4], []])
    assert ids.tolist() == [0, 0, 0] and lens.tolist() == [0]  # nothing on the "device" yet
    inputs.upload()
    assert ids.tolist() == [1, 2, 3] and lens.tolist() == [9] and tables.tolist() == [[1, 2], [3, 4], [0, 0]]
    buffers = {dt: (b.host, b.device) for dt, b in inputs._buffers.items()}
    for step in range(3):  # steps within the capacity neither allocate nor disturb each other
        ids = inputs.longs([step] * 4)
        inputs.upload()
        assert ids.tolist() == [step] * 4
        assert ids.untyped_storage().data_ptr() == buffers[torch.long][1].untyped_storage().data_ptr()
    assert {dt: (b.host, b.device) for dt, b in inputs._buffers.items()} == buffers
    assert inputs.table([]).shape == (0, 0) and inputs.longs([]).shape == (0,)
    inputs.upload()


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "no-copy"])
def test_a_step_that_outgrows_the_buffers_keeps_what_it_handed_out(copy):
    inputs = StepInputs("cpu", copy=copy, pin=False, capacity=8)
    first = inputs.longs(range(6))
    table = inputs.table([[1, 2, 3]] * 3)  # 9 int32: more than the capacity
    second = inputs.longs(range(100, 105))  # 6 + 5 int64: grows mid-step
    inputs.upload()
    assert first.tolist() == list(range(6)) and second.tolist() == list(range(100, 105))
    assert table.tolist() == [[1, 2, 3]] * 3
    assert inputs._buffers[torch.long].host.numel() == 16 and inputs._buffers[torch.int32].host.numel() == 16
    # The grown buffers serve the next steps, from their start.
    again = inputs.longs(range(12))
    inputs.upload()
    assert again.tolist() == list(range(12)) and inputs._buffers[torch.long].host.numel() == 16


def test_triton_metadata_with_and_without_step_inputs_agree():
    pytest.importorskip("triton")
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend

    layout = BatchLayout(4, [9, 17, 20, 21, 22, 40], [[2], [4, 5]], [2, 6], [3, 1], [3, 11], [[5], [10, 11, 12]])
    backend = TritonAttentionBackend(num_sms=4)
    alone = backend.build_metadata(layout, torch.device("cpu"))
    inputs = StepInputs("cpu", copy=True, pin=False)
    staged = backend.build_metadata(layout, torch.device("cpu"), inputs)
    ids = inputs.longs([1, 2, 3, 4, 5, 6])
    inputs.upload()
    for name in ("slot_mapping", "decode_block_tables", "decode_seq_lens", "prefill_block_tables",
                 "prefill_query_start", "prefill_seq_lens"):
        a, b = getattr(alone, name), getattr(staged, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert alone.decode_block_tables.tolist() == [[2, 0], [4, 5]]
    assert alone.prefill_query_start.tolist() == [0, 3, 4]
    assert (alone.num_decodes, alone.decode_max_seq_len, alone.num_prefills, alone.prefill_max_query_len) == \
        (staged.num_decodes, staged.decode_max_seq_len, staged.num_prefills, staged.prefill_max_query_len) == (2, 6, 2, 3)
    # Everything the step uploads lies in two device buffers, one per dtype.
    device_long = inputs._buffers[torch.long].device.untyped_storage().data_ptr()
    device_int = inputs._buffers[torch.int32].device.untyped_storage().data_ptr()
    assert {staged.slot_mapping.untyped_storage().data_ptr(), ids.untyped_storage().data_ptr()} == {device_long}
    assert {t.untyped_storage().data_ptr() for t in (staged.decode_block_tables, staged.decode_seq_lens,
                                                     staged.prefill_block_tables, staged.prefill_query_start,
                                                     staged.prefill_seq_lens)} == {device_int}
