"""The message protocol (header once per channel, packed buffers, trailers announcing a change
of shapes) between in-process ranks, and the loopback group it runs on."""

from __future__ import annotations

import pytest
import torch
from transport_cases import (
    SENT,
    channels_received_out_of_sent_order,
    yields_before_computing,
    yields_per_send,
)

import pipetrain
from pipetrain.distributed.framing import (
    HEADER_SLOTS,
    TRAILER,
    Layout,
    TensorMeta,
    decode_header,
    describe,
    encode_header,
)
from pipetrain.distributed.loopback import LoopbackGroup, LoopbackTransport
from pipetrain.distributed.transport import PeerError
from pipetrain.schedules.messages import CHANNELS, channel_tag


def exchange(messages: list[tuple[tuple, tuple[torch.Tensor, ...]]]) -> list[tuple]:
    """Rank 0 sends each ``(channel, tensors)`` in order; rank 1 receives them in the same
    order; rank 1's received tensors come back."""

    def run(transport: LoopbackTransport) -> list[tuple]:
        if transport.rank == 0:
            for channel, tensors in messages:
                transport.send(tensors, 1, channel)
            transport.flush()
            return []
        return [transport.receive(0, channel) for channel, _ in messages]

    return LoopbackGroup(2, timeout_s=5).run(run)[1]


def assert_same(got: tuple[torch.Tensor, ...], sent: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(sent)
    for received, original in zip(got, sent):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received, original)


def test_a_header_round_trips_every_supported_dtype() -> None:
    metas = (
        TensorMeta((2, 3), torch.float32, True),
        TensorMeta((), torch.int64, False),
        TensorMeta((4, 0, 1), torch.bfloat16, False),
        TensorMeta((5,), torch.bool, False),
    )
    header = encode_header(metas)
    assert header.shape == (HEADER_SLOTS,) and header.dtype == torch.int64
    assert decode_header(header) == metas


def test_a_header_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(TypeError, match="complex64"):
        encode_header(describe([torch.zeros(2, dtype=torch.complex64)]))
    with pytest.raises(ValueError, match="more than 64"):
        encode_header(describe([torch.zeros(1, 1, 1, 1)] * 10))


def test_tensors_of_mixed_dtypes_and_channels_arrive_intact() -> None:
    floats = torch.randn(3, 5)
    ints = torch.arange(7, dtype=torch.int64).reshape(7, 1)
    halves = torch.randn(2, 2).to(torch.float16)
    flags = torch.tensor([True, False, True])
    bytes_ = torch.arange(3, dtype=torch.uint8)
    messages = [
        (("F", 0), (floats, ints)),
        (("B", 0), (halves,)),
        (("F", 0), (floats * 2, ints + 1)),
        (("T", 0), (flags, bytes_, torch.tensor(3.5, dtype=torch.float64))),
        (("B", 0), (halves - 1,)),
    ]
    received = exchange(messages)
    for got, (_, sent) in zip(received, messages):
        assert_same(got, sent)


def test_a_message_is_each_tensors_bytes_at_16_byte_offsets_with_zeros_between() -> None:
    tensors = (
        torch.arange(3, dtype=torch.int8),
        torch.randn(2, 3).t(),  # not contiguous
        torch.tensor(True),
        torch.randn(5, requires_grad=True) * 2,
    )
    layout = Layout(describe(tensors))
    packed = layout.pack(tensors, torch.device("cpu"))
    expected = torch.zeros(16 + 32 + 16 + 32 + TRAILER, dtype=torch.uint8)
    for tensor, offset in zip(tensors, (0, 16, 48, 64)):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        expected[offset : offset + data.numel()] = data
    assert torch.equal(packed, expected)
    assert layout.size == expected.numel()
    for got, sent in zip(layout.unpack(packed), tensors):
        assert got.shape == sent.shape and torch.equal(got, sent.detach())


def test_a_change_of_shape_mid_channel_is_announced_and_followed() -> None:
    # a smaller last micro-batch, then the old size again, then another dtype
    messages = [
        (("F", 0), (torch.randn(4, 3), torch.arange(4))),
        (("F", 0), (torch.randn(4, 3), torch.arange(4))),
        (("F", 0), (torch.randn(2, 3), torch.arange(2))),
        (("F", 0), (torch.randn(4, 3), torch.arange(4))),
        (("F", 0), (torch.randn(4, 3).double(),)),
        (("F", 0), (torch.randn(4, 3, requires_grad=True).double(),)),
    ]
    received = exchange(messages)
    for got, (_, sent) in zip(received, messages):
        assert_same(got, sent)


def test_the_shapes_travel_once_per_channel() -> None:
    group = LoopbackGroup(2, timeout_s=5)
    first, second = (torch.randn(4, 3),), (torch.randn(2, 3),)

    def run(transport: LoopbackTransport) -> list[int]:
        if transport.rank == 1:
            return []
        sizes = []
        for tensors in (first, first, second):
            transport.send(tensors, 1, ("F", 0))
            sizes.append(group._queues[(0, 1)].qsize())
        return sizes

    sizes = group.run(run)[0]
    data = Layout(describe(first)).size
    # header + data; data only; stale buffer + header + data
    assert sizes == [2, 3, 6]
    assert data == 4 * 3 * 4 + TRAILER


def test_an_empty_tuple_is_a_message() -> None:
    received = exchange([(("O", 0), ()), (("O", 0), ()), (("O", 0), (torch.ones(1),))])
    assert received[0] == () and received[1] == ()
    assert_same(received[2], (torch.ones(1),))


def test_posted_receives_complete_when_waited_on() -> None:
    def run(transport: LoopbackTransport) -> list[tuple]:
        if transport.rank == 0:
            transport.send((torch.ones(2),), 1, ("F", 0))
            transport.send((torch.zeros(3),), 1, ("B", 0))
            transport.send((torch.full((2,), 7.0),), 1, ("F", 0))
            return []
        posted = transport.post_receive(0, ("F", 0))
        first = posted.wait()
        return [first, transport.receive(0, ("B", 0)), transport.post_receive(0, ("F", 0)).wait()]

    got = LoopbackGroup(2, timeout_s=5).run(run)[1]
    assert_same(got[0], (torch.ones(2),))
    assert_same(got[1], (torch.zeros(3),))
    assert_same(got[2], (torch.full((2,), 7.0),))


def test_a_receive_without_a_sender_times_out_naming_the_peer() -> None:
    def run(transport: LoopbackTransport) -> None:
        if transport.rank == 1:
            transport.receive(0, ("F", 0))

    with pytest.raises(
        PeerError, match=r"communication with rank 0 failed: no answer within 0.2 s"
    ):
        LoopbackGroup(2, timeout_s=0.2).run(run)


def test_a_failing_rank_releases_the_ranks_waiting_on_it() -> None:
    def run(transport: LoopbackTransport) -> None:
        if transport.rank == 0:
            raise ValueError("rank 0 broke")
        transport.receive(0, ("F", 0))

    # rank 0's own error, not rank 1's timeout: the waiting rank was released
    with pytest.raises(ValueError, match="rank 0 broke"):
        LoopbackGroup(2, timeout_s=30).run(run)


def test_a_message_of_the_wrong_size_is_a_protocol_error() -> None:
    group = LoopbackGroup(2, timeout_s=5)

    def run(transport: LoopbackTransport) -> None:
        if transport.rank == 0:
            transport.send((torch.ones(4),), 1, ("F", 0))
            # a second buffer that claims nothing about a change of shape
            group.put(0, 1, torch.zeros(3, dtype=torch.uint8))
        else:
            transport.receive(0, ("F", 0))
            transport.receive(0, ("F", 0))

    with pytest.raises(PeerError, match="3 bytes arrived where 24 were expected"):
        group.run(run)


def test_all_reduce_gives_every_rank_the_same_sum() -> None:
    values = [0.1, 0.2, 0.3]

    def run(transport: LoopbackTransport) -> list[float]:
        sums = []
        for round_index in range(3):
            total = torch.tensor(values[transport.rank] * (round_index + 1))
            transport.all_reduce(total)
            sums.append(float(total))
        return sums

    results = LoopbackGroup(3, timeout_s=5).run(run)
    assert results[0] == results[1] == results[2]
    assert results[0] == pytest.approx([0.6, 1.2, 1.8])


def test_over_gloo_each_channel_is_matched_apart_so_its_receive_can_wait_posted() -> None:
    """A receive outstanding on one channel while another channel's messages, sent before
    and after its own, are taken: each is matched by its channel's tag, shapes and all."""
    results = pipetrain.launch(
        channels_received_out_of_sent_order, 2, timeout_s=120, threads_per_worker=1
    )
    apart, received = results[1]
    order = [i for i, (c, _) in enumerate(SENT) if c == ("B", 1)]
    order += [i for i, (c, _) in enumerate(SENT) if c == ("F", 0)]
    assert apart and results[0][0]
    assert received == [(index, list(SENT[index][1])) for index in order]


def test_every_schedule_channel_has_a_tag_of_its_own_and_other_names_share_zero() -> None:
    families = {family for family, _, _ in CHANNELS.values()}
    names = [(family, boundary) for family in sorted(families) for boundary in range(64)]
    tags = [channel_tag(name) for name in names]
    assert min(tags) >= 1 and len(set(tags)) == len(names)
    assert [channel_tag(name) for name in ("message", ("F", -1), ("X", 0), ("F", 0, 1))] == [0] * 4


def test_over_gloo_a_send_yields_the_core_once_posted() -> None:
    """gloo's event-loop thread, deferred, sends a buffer's bytes when the sending thread
    lets it: every posted buffer is followed by a yield."""
    results = pipetrain.launch(yields_per_send, 2, timeout_s=120, threads_per_worker=1)
    yields, buffers = results[0]
    assert yields == buffers == 3


def test_over_gloo_the_transport_yields_before_computing_only_while_a_send_is_under_way() -> None:
    results = pipetrain.launch(yields_before_computing, 2, timeout_s=120, threads_per_worker=1)
    assert results[0] == (1, 0)
