"""The binary audio frame header is defined once (voicelane_wire) and every Python reader and writer uses it."""

import ast
from pathlib import Path

import pytest

import server.audio
import voicelane_wire
from voicelane_wire import HEADER_SIZE, pack_frame, unpack_frame

ROOT = Path(__file__).resolve().parent.parent


def test_round_trip_and_wrap():
    data = pack_frame(7, 2**32 + 3, 2**32 + 480, b"xy", first=True, segment_start=True)
    header, payload = unpack_frame(data)
    assert len(data) == HEADER_SIZE + 2 and payload == b"xy"
    assert (header.stream_id, header.seq, header.start_sample) == (7, 3, 480)
    assert header.first and header.segment_start and not header.last
    with pytest.raises(ValueError):
        unpack_frame(data[:HEADER_SIZE - 1])
    with pytest.raises(ValueError):
        unpack_frame(b"\x02" + data[1:])  # an unknown version


def test_the_server_writes_the_wire_modules_header():
    assert server.audio.pack_frame is voicelane_wire.pack_frame


@pytest.mark.parametrize("folder", ["server", "voicelane_client", "client_demo", "bench", "tests"])
def test_no_other_python_module_packs_the_header(folder):
    """The header's struct format appears in voicelane_wire only (the browser page's copy is JavaScript)."""
    offenders = []
    for path in (ROOT / folder).rglob("*.py"):
        if path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == ">BBHIII":
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
