"""The relay's event stream sends its headers with its first chunk, in one write.

aiohttp has no public switch for it: :class:`proxy.request.relay.EventStream` sets the class
attribute aiohttp's own ``Response`` sets. ``pyproject.toml`` pins aiohttp to the versions where
that holds; this test fails the day the attribute goes or stops working.
"""

from __future__ import annotations

from unittest import mock

from aiohttp import web
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from proxy.request.relay import EventStream


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, lines: list[bytes]) -> None:
        self.writes.append(b"".join(lines))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


def test_aiohttp_still_has_the_switch() -> None:
    assert web.StreamResponse._send_headers_immediately is True
    assert web.Response._send_headers_immediately is False
    assert EventStream._send_headers_immediately is False


async def test_headers_leave_with_the_first_chunk_in_one_write() -> None:
    transport = RecordingTransport()
    protocol = mock.Mock(transport=transport)
    writer = StreamWriter(protocol, mock.Mock())
    request = make_mocked_request("POST", "/v1/completions", writer=writer, protocol=protocol, transport=transport)
    out = EventStream(status=200, headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    assert transport.writes == []  # nothing left on prepare
    await out.write(b"data: 1\n\n")
    assert len(transport.writes) == 1
    head, body = transport.writes[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Transfer-Encoding: chunked" in head
    assert body == b"9\r\ndata: 1\n\n\r\n"
