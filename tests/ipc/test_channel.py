"""The control channel's framing: every whole message that has arrived is read at once,
partial ones wait for their rest, and a bad one ends the channel after the good ones before
it were delivered."""

from __future__ import annotations

import asyncio

import pytest

from service.ipc import channel


def _read_all(chunks: list[bytes]) -> tuple[list[list[channel.Message]], BaseException | None]:
    async def run() -> tuple[list[list[channel.Message]], BaseException | None]:
        stream = asyncio.StreamReader()
        for chunk in chunks:
            stream.feed_data(chunk)
        stream.feed_eof()
        reader = channel.Reader(stream)
        batches: list[list[channel.Message]] = []
        try:
            while True:
                batches.append(await reader.read())
        except (channel.ChannelClosed, ValueError) as err:
            return batches, err

    return asyncio.run(run())


def test_whole_messages_come_together_and_a_split_one_waits_for_its_rest() -> None:
    a, b, c = (channel.encode({"t": "x", "id": i}) for i in range(3))

    async def run() -> list[list[int]]:
        stream = asyncio.StreamReader()
        reader = channel.Reader(stream)
        stream.feed_data(a + b + c[:5])
        first = await reader.read()
        waiting = asyncio.ensure_future(reader.read())
        await asyncio.sleep(0)
        assert not waiting.done()  # half a message is not a message
        stream.feed_data(c[5:])
        return [[m["id"] for m in batch] for batch in (first, await waiting)]

    assert asyncio.run(run()) == [[0, 1], [2]]


def test_a_malformed_message_ends_the_channel_after_the_good_ones_before_it() -> None:
    good = channel.encode({"t": "done", "id": 1})
    bad = channel.HEADER.pack(5) + b"{oops"
    batches, end = _read_all([good + bad])
    assert batches == [[{"t": "done", "id": 1}]]
    assert isinstance(end, ValueError)


def test_an_oversized_header_is_refused_without_reading_its_body() -> None:
    good = channel.encode({"id": 7})
    huge = channel.HEADER.pack(channel.MAX_MESSAGE_BYTES + 1)
    batches, end = _read_all([good + huge])
    assert batches == [[{"id": 7}]]
    assert isinstance(end, ValueError)
    assert "max" in str(end)


def test_a_message_of_the_largest_size_arrives_in_many_chunks() -> None:
    text = "x" * (channel.MAX_MESSAGE_BYTES - 20)
    frame = channel.encode({"s": text})
    assert len(frame) - channel.HEADER.size <= channel.MAX_MESSAGE_BYTES
    step = channel.READ_CHUNK_BYTES
    batches, _ = _read_all([frame[i : i + step] for i in range(0, len(frame), step)])
    assert batches == [[{"s": text}]]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"'])
def test_a_message_that_is_not_an_object_is_refused(body: bytes) -> None:
    batches, end = _read_all([channel.HEADER.pack(len(body)) + body])
    assert batches == []
    assert isinstance(end, ValueError)


INFER = {
    "t": "infer",
    "id": 41,
    "model": "mha/1",
    "w": True,
    "shape": [2, 16, 512],
    "dtype": "<f4",
    "in": 0,
    "out": 65536,
    "wout": 131072,
    "deadline": 812.5,
    "tag": None,
}
DONE = {
    "t": "done",
    "id": 41,
    "q": 0.002,
    "c": 0.0005,
    "b": 6,
    "s": 811.25,
    "p": 0.125,
    "i": 9,
    "tags": [],
}


OUTPUT_ONLY = {key: value for key, value in INFER.items() if key != "wout"} | {"w": False}
TAG = [0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1]


@pytest.mark.parametrize(
    "message",
    [
        INFER,
        DONE,
        OUTPUT_ONLY | {"deadline": None},
        OUTPUT_ONLY,
        INFER | {"tag": TAG},
        DONE | {"tags": [TAG, [1, 2**64 - 1, 0]]},
    ],
    ids=["infer", "done", "infer-no-deadline", "infer-output-only", "traced", "traced-batch"],
)
def test_a_request_s_messages_travel_packed_and_read_back_as_sent(message: dict) -> None:
    framed = channel.encode(message)
    assert not framed[channel.HEADER.size :].startswith(b"{")  # not JSON
    batches, _ = _read_all([framed])
    assert batches == [[message]]


@pytest.mark.parametrize(
    "message",
    [
        {**INFER, "tag": ["00f067aa0ba902b7", 1]},
        {**INFER, "iref": ["r", 0, 64, "x", "<f4"]},
        {**DONE, "tags": [["4bf92f3577b34da6", 1]]},
        {**INFER, "shape": [16, 512]},
        {**DONE, "b": 2.5},
        {**INFER, "model": "m\ud800/1"},
        {**DONE, "tags": [[2**128, 1, 1]]},
    ],
    ids=[
        "odd-tag",
        "client-region",
        "odd-batch-tag",
        "two-dims",
        "odd-value",
        "not-utf-8",
        "tag-too-wide",
    ],
)
def test_what_the_packed_layout_has_no_field_for_goes_as_json_unchanged(message: dict) -> None:
    framed = channel.encode(message)
    assert framed[channel.HEADER.size :].startswith(b"{")
    batches, _ = _read_all([framed])
    assert batches == [[message]]


def test_a_truncated_packed_message_ends_the_channel_after_the_good_ones() -> None:
    good, packed = channel.encode(DONE), channel.encode(INFER)
    body = packed[channel.HEADER.size : -3]  # its dtype name cut short
    batches, end = _read_all([good + channel.HEADER.pack(len(body)) + body])
    assert batches == [[DONE]]
    assert isinstance(end, ValueError)
