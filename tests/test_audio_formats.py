"""Binary frame header, WAV, MP3 and the per-stream encoders the gateway uses."""

import io
import sys
import wave

import numpy as np
import pytest

from server.audio import (
    CONTENT_TYPES,
    HEADER_SIZE,
    Mp3Output,
    Mp3UnavailableError,
    OpusOutput,
    PcmOutput,
    float_to_s16le,
    open_audio_file,
    pack_frame,
    pack_header,
    unpack_frame,
    wav_header,
)

SR = 24000


def sine(freq, n, amp=0.5):
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / SR)).astype(np.float32)


# ------------------------------------------------------------------------------------------------- frames


def test_frame_header_bytes():
    h = pack_header(0x01020304, 5, 48000, first=True, segment_start=True)
    assert h == bytes.fromhex("01 01 0005 01020304 00000005 0000bb80")
    assert len(h) == HEADER_SIZE
    assert pack_header(1, 0, 0, last=True)[2:4] == b"\x00\x02"
    assert pack_header(1, 0, 0, first=True, last=True, segment_start=True)[2:4] == b"\x00\x07"
    # seq and start_sample wrap like RTP timestamps
    assert pack_header(1, 2**32 + 3, 2**32 + 9)[8:] == bytes.fromhex("00000003 00000009")
    with pytest.raises(ValueError):
        pack_header(2**32, 0, 0)
    with pytest.raises(ValueError):
        pack_header(1, -1, 0)


def test_frame_round_trip():
    payload = bytes(range(40))
    frame = pack_frame(77, 12, 123456, payload, last=True)
    header, body = unpack_frame(frame)
    assert body == payload
    assert (header.stream_id, header.seq, header.start_sample) == (77, 12, 123456)
    assert header.last and not header.first and not header.segment_start
    assert (header.version, header.kind) == (1, 1)
    header, body = unpack_frame(pack_frame(1, 0, 0, first=True, segment_start=True))
    assert body == b"" and header.first and header.segment_start and not header.last
    with pytest.raises(ValueError):
        unpack_frame(b"\x01\x01\x00")
    with pytest.raises(ValueError):
        unpack_frame(b"\x02" + bytes(15))
    with pytest.raises(ValueError):
        unpack_frame(b"\x01\x02" + bytes(14))


# ---------------------------------------------------------------------------------------------------- WAV


def test_streaming_wav_header_bytes():
    expected = bytes.fromhex(
        "52494646 ffffffff 57415645"  # RIFF, size unknown, WAVE
        "666d7420 10000000 0100 0100 c05d0000 80bb0000 0200 1000"  # fmt: PCM, mono, 24000 Hz, 48000 B/s, 2, 16
        "64617461 ffffffff"  # data, size unknown
    )
    assert wav_header(24000) == expected
    assert len(expected) == 44


def test_finite_wav_header_and_whole_file():
    assert wav_header(16000, num_samples=10)[4:8] == (36 + 20).to_bytes(4, "little")
    assert wav_header(16000, num_samples=10)[40:44] == (20).to_bytes(4, "little")
    x = sine(440.0, 5000)
    wav = open_audio_file("wav")  # a whole (stream: false) WAV response: exact sizes, the length being known
    head = wav.header()
    body = b"".join(wav.body(wav.output.encode(x[i : i + 1920])) for i in range(0, len(x), 1920))
    data = wav.whole(head, body + wav.end(wav.output.close()))
    assert data[:44] == wav_header(24000, num_samples=len(x))
    assert data[44:] == float_to_s16le(x)
    with wave.open(io.BytesIO(data)) as r:
        assert (r.getnchannels(), r.getsampwidth(), r.getframerate(), r.getnframes()) == (1, 2, 24000, len(x))


# ---------------------------------------------------------------------------------------------------- MP3

_MPEG2_L3_KBPS = [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160]


def mp3_frames(data):
    """Walk MPEG-2 Layer III frame headers from the start (skipping an ID3v2 tag); returns frame count."""
    pos = 0
    if data[:3] == b"ID3":
        size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]
        pos = 10 + size
    frames = 0
    while pos < len(data):
        h = int.from_bytes(data[pos : pos + 4], "big")
        assert h >> 21 == 0x7FF, f"no frame sync at {pos}"
        version, layer = (h >> 19) & 3, (h >> 17) & 3
        assert version == 2 and layer == 1  # MPEG-2, Layer III
        kbps = _MPEG2_L3_KBPS[(h >> 12) & 0xF]
        assert (h >> 10) & 3 == 1  # 24000 Hz in MPEG-2
        assert (h >> 6) & 3 == 3  # mono
        padding = (h >> 9) & 1
        pos += 72 * kbps * 1000 // 24000 + padding
        frames += 1
    assert pos == len(data)
    return frames


def test_mp3_stream():
    n = SR * 2
    x = sine(440.0, n)
    enc = Mp3Output(bitrate_kbps=64)
    parts = [b"".join(p.payload for p in enc.encode(x[i : i + 1920])) for i in range(0, n, 1920)]
    assert sum(len(p) for p in parts[:5]) > 0  # bytes come out while streaming, not only at the end
    assert enc.flush() == []  # LAME holds audio back until close()
    parts += [p.payload for p in enc.close()]
    data = b"".join(parts)
    assert data[:2] in (b"\xff\xf3", b"\xff\xf2") or data[:3] == b"ID3"
    frames = mp3_frames(data)
    # 576 samples per frame: the input plus LAME's delay and padding (under 3 frames)
    assert n <= frames * 576 <= n + 3 * 576
    assert abs(len(data) * 8 / (frames * 576 / SR) - 64000) < 2000
    with pytest.raises(RuntimeError):
        enc.encode(x)


def test_missing_lameenc_is_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "lameenc", None)
    with pytest.raises(Mp3UnavailableError, match="pip install lameenc"):
        Mp3Output()


# ------------------------------------------------------------------------------------ outputs and files


@pytest.mark.parametrize(
    "encoding,rate,bps",
    [("pcm_s16le", 24000, 2), ("pcm_f32le", 24000, 4), ("pcm_s16le", 16000, 2), ("pcm_mulaw", 8000, 1)],
)
def test_ws_pcm_encoder_timeline(encoding, rate, bps):
    enc = PcmOutput(encoding, rate)
    assert enc.clock_rate == rate and enc.pre_skip == 0
    x = sine(440.0, 5000)
    packets = []
    for seg in range(2):
        for i in range(0, len(x), 1920):
            packets += enc.encode(x[i : i + 1920])
        packets += enc.flush()
        assert enc.audio_end_ms == pytest.approx((seg + 1) * -(-len(x) * rate // SR) * 1000 / rate)
    packets += enc.close()
    pos = 0
    for p in packets:
        assert p.start_sample == pos and len(p.payload) == p.samples * bps
        pos += p.samples
    assert pos == 2 * -(-len(x) * rate // SR)


def test_ws_opus_encoder():
    enc = OpusOutput(bitrate=32000)
    assert enc.clock_rate == 48000 and enc.pre_skip == 312
    x = sine(440.0, 5000)
    packets = enc.encode(x) + enc.flush()
    assert [p.start_sample for p in packets] == [960 * i for i in range(len(packets))]
    assert all(p.samples == 960 for p in packets)
    assert enc.audio_end_ms == pytest.approx(len(x) / 24.0)
    assert enc.close() == []
    with pytest.raises(RuntimeError):
        enc.encode(x)


def test_http_encoders():
    x = sine(440.0, 5000)
    pcm = open_audio_file("pcm")
    assert pcm.content_type == "audio/pcm" and pcm.header() == b""
    assert pcm.body(pcm.output.encode(x)) == float_to_s16le(x) and pcm.end(pcm.output.close()) == b""
    wav = open_audio_file("wav")
    assert wav.content_type == "audio/wav" and wav.header() == wav_header(24000)
    assert wav.body(wav.output.encode(x)) == float_to_s16le(x)
    assert set(CONTENT_TYPES) == {"pcm", "wav", "opus", "mp3"}
    with pytest.raises(ValueError):
        open_audio_file("flac")
