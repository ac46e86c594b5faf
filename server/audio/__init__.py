"""Everything between the model's float PCM (24 kHz mono float32) and the bytes that leave the server: silence
trimming per segment (trim), PCM conversions and resampling (pcm), the Ogg Opus muxer (ogg), one output per encoding
for both doors, Opus and MP3 included (encoders), the HTTP response files and their WAV header (containers), one
context's trimming and output (stream); and the binary frame header, re-exported from voicelane_wire.

Codec libraries are imported only when an encoder that needs them is built, so this package imports without them.
"""

from voicelane_wire import (
    FLAG_FIRST,
    FLAG_LAST,
    FLAG_SEGMENT_START,
    HEADER_SIZE,
    FrameHeader,
    pack_frame,
    pack_header,
    unpack_frame,
)

from .containers import CONTENT_TYPES, HTTP_FORMATS, AudioFile, open_audio_file, wav_header
from .encoders import (
    AudioOutput,
    AudioPacket,
    Mp3Output,
    Mp3UnavailableError,
    OpusOutput,
    OpusUnavailableError,
    PcmOutput,
)
from .ogg import OggOpusWriter, opus_packet_samples
from .pcm import (
    PCM_CONVERSIONS,
    Resampler,
    float_to_f32le,
    float_to_mulaw,
    float_to_s16,
    float_to_s16le,
    mulaw_to_s16,
    s16_to_float,
    s16_to_mulaw,
)
from .stream import AudioStream
from .trim import LeadingSilenceTrimmer

__all__ = [
    "CONTENT_TYPES", "FLAG_FIRST", "FLAG_LAST", "FLAG_SEGMENT_START", "HEADER_SIZE", "HTTP_FORMATS", "PCM_CONVERSIONS",
    "AudioFile", "AudioOutput", "AudioPacket", "AudioStream", "FrameHeader", "LeadingSilenceTrimmer", "Mp3Output",
    "Mp3UnavailableError", "OggOpusWriter", "OpusOutput", "OpusUnavailableError",
    "PcmOutput", "Resampler", "float_to_f32le", "float_to_mulaw", "float_to_s16", "float_to_s16le", "mulaw_to_s16",
    "open_audio_file", "opus_packet_samples", "pack_frame", "pack_header", "s16_to_float", "s16_to_mulaw",
    "unpack_frame", "wav_header",
]
