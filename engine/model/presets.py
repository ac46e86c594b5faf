"""Published configuration of the Qwen3-TTS 12 Hz CustomVoice checkpoints, and a tiny variant for tests.

Values are those of the published config.json / generation_config.json / speech_tokenizer/config.json
(see docs/model.md); the tiny variant keeps every id, table and vocabulary and shrinks only the widths.
"""

from __future__ import annotations

import copy

SPEAKER_IDS = {"serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
               "sohee": 2864, "eric": 2875, "dylan": 2878}
SPEAKER_DIALECT = {**{name: False for name in SPEAKER_IDS}, "eric": "sichuan_dialect", "dylan": "beijing_dialect"}
LANGUAGE_IDS = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
                "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
                "beijing_dialect": 2074, "sichuan_dialect": 2062}

GENERATION_CONFIG = {"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
                     "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50,
                     "subtalker_top_p": 1.0, "max_new_tokens": 8192}

SIZES = ("tiny", "0.6b", "1.7b")


def _stack(hidden, inter, layers, heads, kv_heads, head_dim, vocab) -> dict:
    return {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "vocab_size": vocab, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000, "initializer_range": 0.02, "use_cache": True,
            "sliding_window": None, "use_sliding_window": False}


def model_config(size: str) -> dict:
    """config.json of a checkpoint of the given size, in the published layout."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}; choose one of {SIZES}")
    if size == "tiny":
        talker = _stack(64, 128, 2, 4, 2, 32, 3072) | {"text_hidden_size": 32}
        cp = _stack(48, 96, 2, 4, 2, 16, 2048)
        mrope = [6, 5, 5]  # sums to head_dim / 2
    else:
        hidden, inter = (2048, 6144) if size == "1.7b" else (1024, 3072)
        talker = _stack(hidden, inter, 28, 16, 8, 128, 3072) | {"text_hidden_size": 2048}
        cp = _stack(1024, 3072, 5, 16, 8, 128, 2048)
        mrope = [24, 20, 20]
    cp |= {"model_type": "qwen3_tts_talker_code_predictor", "num_code_groups": 16, "max_position_embeddings": 65536,
           "layer_types": ["full_attention"] * cp["num_hidden_layers"], "max_window_layers": 28,
           "rope_scaling": None}
    talker |= {
        "model_type": "qwen3_tts_talker", "code_predictor_config": cp, "num_code_groups": 16,
        "text_vocab_size": 151936, "max_position_embeddings": 32768, "position_id_per_seconds": 13,
        "rope_scaling": {"interleaved": True, "mrope_section": mrope, "rope_type": "default", "type": "default"},
        "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148, "codec_think_id": 2154,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "codec_language_id": dict(LANGUAGE_IDS), "spk_id": dict(SPEAKER_IDS), "spk_is_dialect": dict(SPEAKER_DIALECT),
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "assistant_token_id": 77091, "im_end_token_id": 151645, "im_start_token_id": 151644,
        "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "tts_pad_token_id": 151671,
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": "0b6" if size == "0.6b" else "1b7",
        "tts_model_type": "custom_voice", "talker_config": talker, "transformers_version": "4.57.3",
    }


def codec_config(size: str) -> dict:
    """speech_tokenizer/config.json (decoder part; the encoder is only needed for voice cloning)."""
    decoder = {"attention_bias": False, "latent_dim": 1024, "codebook_dim": 512, "codebook_size": 2048,
               "decoder_dim": 1536, "hidden_act": "silu", "hidden_size": 512, "intermediate_size": 1024,
               "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000, "head_dim": 64,
               "num_attention_heads": 16, "num_hidden_layers": 8, "num_key_value_heads": 16, "num_quantizers": 16,
               "num_semantic_quantizers": 1, "semantic_codebook_size": 4096,
               "vector_quantization_hidden_dimension": 512, "rms_norm_eps": 1e-05, "rope_theta": 10000,
               "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2]}
    if size == "tiny":
        decoder |= {"codebook_dim": 64, "latent_dim": 64, "hidden_size": 32, "head_dim": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "intermediate_size": 64, "num_hidden_layers": 2, "decoder_dim": 96,
                    "vector_quantization_hidden_dimension": 64}
    return {"model_type": "qwen3_tts_tokenizer_12hz", "input_sample_rate": 24000, "output_sample_rate": 24000,
            "encoder_valid_num_quantizers": 16, "encode_downsample_rate": 1920, "decode_upsample_rate": 1920,
            "decoder_config": copy.deepcopy(decoder)}


# What AutoFeatureExtractor needs to load the speech tokenizer directory (the encoder side is unused here).
PREPROCESSOR_CONFIG = {"feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "sampling_rate": 24000,
                       "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
                       "chunk_length_s": None, "overlap": None}
