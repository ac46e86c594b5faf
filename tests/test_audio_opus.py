"""Opus encoder (checked with opuslib's decoder) and the Ogg Opus muxer (checked with our own page reader and,
when opus-tools is installed, opusinfo / opusdec)."""

import os
import shutil
import struct
import subprocess
import sys
import wave

import numpy as np
import opuslib  # required, not skipped: CI installs opuslib and libopus0 (a missing one must fail loudly)
import pytest

from server.audio import OggOpusWriter, OpusOutput, OpusUnavailableError, open_audio_file
from server.audio.ogg import ogg_crc, opus_packet_samples

SR = 24000


def sine(freq, n, amp=0.5, rate=SR):
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / rate)).astype(np.float32)


def encode_all(enc, x, chunk=1920):
    packets = []
    for i in range(0, len(x), chunk):
        packets += enc.encode(x[i : i + chunk])
    return packets


def decode(packets):
    dec = opuslib.Decoder(48000, 1)
    return np.concatenate([np.frombuffer(dec.decode_float(p.payload, 5760), np.float32) for p in packets])


def fitted_snr_db(y, freq, rate=48000, block=4800):
    """Worst SNR over blocks of a least-squares fit of a sine at `freq` (free amplitude and phase)."""
    t = np.arange(len(y)) / rate
    basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], 1)
    worst = np.inf
    for k in range(0, len(y) - block + 1, block):
        sl = slice(k, k + block)
        c, *_ = np.linalg.lstsq(basis[sl], y[sl], rcond=None)
        fit = basis[sl] @ c
        worst = min(worst, 10 * np.log10(np.sum(fit**2) / np.sum((y[sl] - fit) ** 2)))
    return worst


def test_pre_skip_and_packets():
    enc = OpusOutput()
    assert enc.pre_skip == 2 * enc.lookahead == 312  # libopus lookahead at 24 kHz: 2.5 + 4 ms
    n = SR // 2 + 100
    packets = encode_all(enc, sine(1000.0, n))
    assert len(packets) == n // 480 and enc.held == 100
    assert all(p.samples == 960 == opus_packet_samples(p.payload) for p in packets)
    tail = enc.close()
    # the 100 held samples plus the 156-sample lookahead fit in one padded 20 ms packet
    assert len(tail) == 1 and tail[0].samples == 960
    packets += tail
    assert [p.start_sample for p in packets] == [960 * i for i in range(len(packets))]
    # real audio ends inside the padded packet, after its 100 held samples and the pre-skip
    assert enc.end_sample == enc.pre_skip + 2 * n == tail[0].start_sample + 2 * 100 + enc.pre_skip
    with pytest.raises(RuntimeError):
        enc.encode(sine(1000.0, 10))


@pytest.mark.parametrize("chunk", [1920, 333, 480])
def test_decoded_duration_frequency_and_snr(chunk):
    n = SR + 123
    x = sine(1000.0, n)
    enc = OpusOutput(bitrate=32000)
    packets = encode_all(enc, x, chunk) + enc.close()
    y = decode(packets)
    assert len(y) == sum(p.samples for p in packets)
    y = y[enc.pre_skip : enc.end_sample]
    assert len(y) == 2 * n  # after pre-skip and end trimming: exactly the input duration at 48 kHz
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    assert abs(np.argmax(spec) * 48000 / len(y) - 1000.0) <= 2.0
    assert fitted_snr_db(y[2400:-2400], 1000.0) > 15.0
    # time alignment: the decoded tone is in phase with the input's within 0.1 ms
    ref = sine(1000.0, len(y), rate=48000)
    lag = np.argmax(np.correlate(y[4800:9600], ref[4800 - 24 : 9600 + 24], mode="valid")) - 24
    assert abs(lag) <= 5


def test_flush_keeps_timeline_and_stream_continues():
    enc = OpusOutput()
    a, b = sine(500.0, 4900), sine(1500.0, 7000)
    p1 = encode_all(enc, a)
    p1 += enc.flush()
    end1 = enc.end_sample
    assert end1 == enc.pre_skip + 2 * len(a)
    assert enc.flush() == []  # nothing new
    start_b = enc.samples_fed  # the next segment starts after the flush's padding
    assert 0 <= start_b - len(a) - enc.lookahead < 480
    p2 = encode_all(enc, b) + enc.close()
    assert enc.end_sample == enc.pre_skip + 2 * (start_b + len(b))
    packets = p1 + p2
    assert [p.start_sample for p in packets] == [960 * i for i in range(len(packets))]
    y = decode(packets)[enc.pre_skip :]
    gap = y[2 * len(a) + 240 : 2 * start_b - 120]  # the inserted silence, less the codec's smear at its edges
    assert len(gap) >= 400 and np.sqrt(np.mean(gap**2)) < 0.01
    seg_b = y[2 * start_b + 960 : 2 * (start_b + len(b)) - 960]
    spec = np.abs(np.fft.rfft(seg_b * np.hanning(len(seg_b))))
    assert abs(np.argmax(spec) * 48000 / len(seg_b) - 1500.0) < 10


def test_bitrate_setting_changes_size():
    x = (np.random.default_rng(1).standard_normal(SR) * 0.2).astype(np.float32)
    sizes = {}
    for br in (16000, 64000):
        enc = OpusOutput(bitrate=br)
        sizes[br] = sum(len(p.payload) for p in encode_all(enc, x) + enc.close())
    assert sizes[64000] > 2.5 * sizes[16000]
    assert 0.6 < sizes[64000] * 8 / 1.0 / 64000 < 1.3


def test_missing_opuslib_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "opuslib", None)
    with pytest.raises(OpusUnavailableError, match="apt-get install libopus0"):
        OpusOutput()


# ---------------------------------------------------------------------------------------------------- Ogg


def read_ogg(data):
    """Our own small Ogg reader: returns pages as dicts; checks capture pattern, version and CRC."""
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"OggS", f"no capture pattern at {pos}"
        version, flags, granule, serial, seq, crc, nseg = struct.unpack_from("<BBqIIIB", data, pos + 4)
        assert version == 0
        lacing = data[pos + 27 : pos + 27 + nseg]
        body_len = sum(lacing)
        end = pos + 27 + nseg + body_len
        page = bytearray(data[pos:end])
        page[22:26] = b"\0\0\0\0"
        assert ogg_crc(bytes(page)) == crc, f"bad CRC on page {seq}"
        packets, cur, off = [], b"", pos + 27 + nseg
        for v in lacing:
            cur += data[off : off + v]
            off += v
            if v < 255:
                packets.append(cur)
                cur = b""
        assert cur == b"", "packet continued past the page (the muxer never does that)"
        pages.append(dict(flags=flags, granule=granule, serial=serial, seq=seq, packets=packets))
        pos = end
    return pages


def test_ogg_crc_known_value():
    # CRC-32/POSIX ("cksum" polynomial, no reflection, init 0) without its final xor
    assert ogg_crc(b"123456789") == 0x765E7680 ^ 0xFFFFFFFF
    assert ogg_crc(b"") == 0


def make_ogg(x, chunk=1920):
    file = open_audio_file("opus")
    parts = [file.header()]
    for i in range(0, len(x), chunk):
        parts.append(file.body(file.output.encode(x[i : i + chunk])))
    parts.append(file.end(file.output.close()))
    return file, parts


def test_ogg_pages_headers_granules():
    n = SR + 777
    enc, parts = make_ogg(sine(440.0, n))
    assert parts[0][:4] == b"OggS" and all(p == b"" or p[:4] == b"OggS" for p in parts)
    data = b"".join(parts)
    pages = read_ogg(data)
    assert [p["seq"] for p in pages] == list(range(len(pages)))
    assert len({p["serial"] for p in pages}) == 1
    head, tags = pages[0], pages[1]
    assert head["flags"] == 0x02 and head["granule"] == 0 and len(head["packets"]) == 1
    oh = head["packets"][0]
    assert oh[:8] == b"OpusHead" and len(oh) == 19
    version, channels, pre_skip, rate, gain, family = struct.unpack("<BBHIhB", oh[8:])
    assert (version, channels, pre_skip, rate, gain, family) == (1, 1, 312, 24000, 0, 0)
    assert tags["flags"] == 0 and tags["packets"][0][:8] == b"OpusTags" and tags["granule"] == 0
    vlen = struct.unpack_from("<I", tags["packets"][0], 8)[0]
    assert tags["packets"][0][12 : 12 + vlen] == b"voicelane"
    audio = pages[2:]
    assert all(p["flags"] == 0 for p in audio[:-1]) and audio[-1]["flags"] == 0x04
    total = 0
    for p in audio[:-1]:
        total += sum(opus_packet_samples(q) for q in p["packets"])
        assert p["granule"] == total
    n_packets = sum(len(p["packets"]) for p in audio)
    assert n_packets == -(-(n + 156) // 480)
    # final granule: pre-skip + the input duration at 48 kHz (end trimming)
    assert audio[-1]["granule"] == 312 + 2 * n
    assert audio[-1]["granule"] <= total + sum(opus_packet_samples(q) for q in audio[-1]["packets"])
    # one page per encode() call that completed packets (four 20 ms packets per 80 ms chunk)
    assert max(len(p["packets"]) for p in audio) == 4


def test_ogg_writer_splits_pages_and_validates():
    w = OggOpusWriter(312, serial=7)
    head = w.headers()
    with pytest.raises(RuntimeError):
        w.headers()
    pkt = b"\xf8" + bytes(599)  # CELT FB 20 ms, code 0: 3 lacing values each
    data = w.write([pkt] * 100)
    pages = read_ogg(head + data)
    assert [len(p["packets"]) for p in pages[2:]] == [85, 15]
    assert [p["granule"] for p in pages[2:]] == [85 * 960, 100 * 960]
    with pytest.raises(ValueError):
        w.write([pkt], last=True, end_granule=10)
    end = w.write([pkt], last=True, end_granule=100 * 960 + 500)
    last = read_ogg(end)[0]
    assert last["flags"] == 0x04 and last["granule"] == 100 * 960 + 500
    with pytest.raises(RuntimeError):
        w.write([pkt])


def test_opus_packet_samples_toc():
    assert opus_packet_samples(bytes([(1 << 3) | 0])) == 960  # SILK NB 20 ms
    assert opus_packet_samples(bytes([(12 << 3) | 1, 0])) == 960  # hybrid 10 ms, two frames
    assert opus_packet_samples(bytes([(16 << 3) | 3, 0x05])) == 600  # CELT 2.5 ms, five frames
    assert opus_packet_samples(bytes([(31 << 3) | 0])) == 960


def test_ogg_with_opus_tools(tmp_path):
    if shutil.which("opusinfo") is None or shutil.which("opusdec") is None:
        if os.environ.get("CI"):
            pytest.fail("opus-tools not installed (CI installs it: apt-get install opus-tools)")
        pytest.skip("opus-tools not installed (apt-get install opus-tools)")
    n = SR + 777
    _, parts = make_ogg(sine(440.0, n), chunk=1000)
    path = tmp_path / "t.opus"
    path.write_bytes(b"".join(parts))
    info = subprocess.run(["opusinfo", str(path)], capture_output=True, text=True, timeout=20)
    assert info.returncode == 0, info.stdout + info.stderr
    text = info.stdout + info.stderr
    assert "WARNING" not in text and "ERROR" not in text.upper().replace("ERRORS", ""), text
    assert "Pre-skip: 312" in text and "Original sample rate: 24000" in text
    wav_path = tmp_path / "t.wav"
    dec = subprocess.run(["opusdec", "--quiet", str(path), str(wav_path)], capture_output=True, timeout=20)
    assert dec.returncode == 0, dec.stderr
    with wave.open(str(wav_path)) as w:
        assert w.getframerate() == 24000
        assert w.getnframes() == n  # pre-skip and end trimming give back exactly the input length
