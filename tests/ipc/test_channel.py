"""The control channel's framing: every whole message that has arrived is read at once,
partial ones wait for their rest, and a bad one ends the channel after the good ones before
it were delivered. What the messages hold: test_codec.py."""

from __future__ import annotations

import asyncio

import pytest

from service.ipc import channel
from service.ipc.records import Cancel, Message, Reply
from tests.ipc.test_codec import DONE, INFER


def _read_all(chunks: list[bytes]) -> tuple[list[list[Message]], BaseException | None]:
    async def run() -> tuple[list[list[Message]], BaseException | None]:
        stream = asyncio.StreamReader()
        for chunk in chunks:
            stream.feed_data(chunk)
        stream.feed_eof()
        reader = channel.Reader(stream)
        batches: list[list[Message]] = []
        try:
            while True:
                batches.append(await reader.read())
        except (channel.ChannelClosed, ValueError) as err:
            return batches, err

    return asyncio.run(run())


def test_whole_messages_come_together_and_a_split_one_waits_for_its_rest() -> None:
    a, b, c = (channel.encode(Cancel(i)) for i in range(3))

    async def run() -> list[list[Message]]:
        stream = asyncio.StreamReader()
        reader = channel.Reader(stream)
        stream.feed_data(a + b + c[:5])
        first = await reader.read()
        waiting = asyncio.ensure_future(reader.read())
        await asyncio.sleep(0)
        assert not waiting.done()  # half a message is not a message
        stream.feed_data(c[5:])
        return [first, await waiting]

    assert asyncio.run(run()) == [[Cancel(0), Cancel(1)], [Cancel(2)]]


def test_a_malformed_message_ends_the_channel_after_the_good_ones_before_it() -> None:
    good = channel.encode(Cancel(1))
    bad = channel.HEADER.pack(5) + b"{oops"
    batches, end = _read_all([good + bad])
    assert batches == [[Cancel(1)]]
    assert isinstance(end, ValueError)


def test_an_oversized_header_is_refused_without_reading_its_body() -> None:
    good = channel.encode(Cancel(7))
    huge = channel.HEADER.pack(channel.MAX_MESSAGE_BYTES + 1)
    batches, end = _read_all([good + huge])
    assert batches == [[Cancel(7)]]
    assert isinstance(end, ValueError)
    assert "max" in str(end)


def test_a_message_of_the_largest_size_arrives_in_many_chunks() -> None:
    reply = Reply(1, result="x" * (channel.MAX_MESSAGE_BYTES - 40))
    frame = channel.encode(reply)
    assert len(frame) - channel.HEADER.size <= channel.MAX_MESSAGE_BYTES
    step = channel.READ_CHUNK_BYTES
    batches, _ = _read_all([frame[i : i + step] for i in range(0, len(frame), step)])
    assert batches == [[reply]]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"'])
def test_a_message_that_is_not_an_object_is_refused(body: bytes) -> None:
    batches, end = _read_all([channel.HEADER.pack(len(body)) + body])
    assert batches == []
    assert isinstance(end, ValueError)


def test_a_truncated_packed_message_ends_the_channel_after_the_good_ones() -> None:
    good, packed = channel.encode(DONE), channel.encode(INFER)
    body = packed[channel.HEADER.size : -3]  # its dtype name cut short
    batches, end = _read_all([good + channel.HEADER.pack(len(body)) + body])
    assert batches == [[DONE]]
    assert isinstance(end, ValueError)
