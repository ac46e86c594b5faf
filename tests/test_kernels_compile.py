"""The kernels' GPU code path compiles for the H200 (sm_90) without a GPU: triton's compiler and the ptxas its
wheel ships. The interpreter (the other kernel tests) runs a Python model of the kernels; this catches what only
the compiler sees (types across a loop with a device-scalar bound, branches on constexprs, dot shapes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file():
    pytest.skip("this triton has no bundled ptxas", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)


def _compile(fn, dtype: str, constexprs: dict, pointers: dict[str, str] | None = None, aligned: bool = False,
             warps: int = 4) -> None:
    """Compile `fn` with every `*_ptr` argument of `dtype` (unless `pointers` says otherwise), ints as i32,
    eps and scale as fp32; a kernel with a GDC constexpr three times: without programmatic dependent launch, and
    with it, whose PTX must then wait for the kernel before and let the next one launch, after the wait or (trigger
    early) before it. aligned: every pointer and stride (`s_*`) known to be a multiple of 16, as the launcher
    specialises torch's allocations (without it the compiler cannot vectorise loads or pipeline a loop's copies)."""
    if any(p.name == "GDC" for p in fn.params) and "GDC" not in constexprs:
        assert "griddepcontrol" not in _compile(fn, dtype, constexprs | {"GDC": False}, pointers, aligned, warps)
        early = _compile(fn, dtype, constexprs | {"GDC": 2}, pointers, aligned, warps)  # trigger early: the next may
        assert early.index("griddepcontrol.launch_dependents") < early.index("griddepcontrol.wait")  # launch at once
        ptx = _compile(fn, dtype, constexprs | {"GDC": 1}, pointers, aligned, warps)  # trigger after the wait
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
        return ptx
    pointers = pointers or {}
    signature, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = pointers.get(p.name, f"*{dtype}")
        else:
            signature[p.name] = "fp32" if p.name in ("eps", "scale") else "i32"
        if aligned and not p.is_constexpr and (p.name.endswith("_ptr") or p.name.startswith("s_")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    missing = {n for n, t in signature.items() if t == "constexpr"} - constexprs.keys()
    assert not missing, f"constexprs not given: {missing}"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=H200,
                              options={"num_warps": warps, "num_stages": 3})
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


def _kernel_modules():
    from engine.kernels import attention, norm
    return attention, norm


def compile_norm(dtype: str) -> None:
    _, norm = _kernel_modules()
    for residual in (True, False):
        _compile(norm._add_rms_norm_kernel, dtype, {"HAS_RESIDUAL": residual, "BLOCK": 2048})
    _compile(norm._swiglu_kernel, dtype, {"BLOCK": 1024})


def compile_attention(dtype: str) -> None:
    attention, _ = _kernel_modules()
    ints = {"slots_ptr": "*i64", "pos_ptr": "*i64", "valid_ptr": "*i64"}
    _compile(attention._qk_norm_rope_store_kernel, dtype, {"HALF": 64, "BLOCK_HALF": 64}, ints)
    partials = ints | {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    for splits, valid, block_m in ((1, False, 16), (16, False, 16), (1, True, 64)):  # decode, split decode, prefill
        _compile(attention._cache_attention_kernel, dtype,
                 {"G": 2, "D": 128, "BLOCK_M": block_m, "BLOCK_N": 64, "SPLITS": splits, "HAS_VALID": valid,
                  "IEEE": dtype == "fp32", "INTERPRET": False}, partials)
    _compile(attention._combine_splits_kernel, dtype, {"G": 2, "D": 128, "BLOCK_M": 16, "SPLITS": 16}, partials)
    for block_t in (2, 4):  # the Code Predictor's one launch a layer: its first forward (two tokens) and the rest
        _compile(attention._short_attention_kernel, dtype,
                 {"G": 2, "D": 128, "BLOCK_M": 16, "BLOCK_T": block_t, "BLOCK_N": 16, "IEEE": dtype == "fp32"}, ints)


def compile_linear(dtype: str) -> None:
    from engine.kernels import linear

    pointers = {"part_ptr": "*fp32", "ticket_ptr": "*i32"}
    for swiglu, dot, split, block_m in ((False, True, False, 16), (True, True, True, 64), (True, False, True, 1),
                                        (False, False, False, 4)):
        for preload in (False, True):
            ptx = _compile(linear._skinny_kernel, dtype,
                           {"SWIGLU": swiglu, "DOT": dot, "IEEE": dtype == "fp32", "SPLIT": split, "INTERPRET": False,
                            "BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 256, "LINE": 64, "PRELOAD": preload,
                            "NORM": 0, "NORM_K": 256}, pointers)
            before_wait = ptx.split("griddepcontrol.wait")[0]
            # under PDL the weights are pulled into L2 before the wait for the kernel before, or (preload) read
            assert ("ld.global" if preload else "prefetch.global.L2") in before_wait
    for norm in (1, 2):  # the folded norms in the pipeline's shape (the Code Predictor's K of 1024, two K blocks)
        ptx = _compile(linear._skinny_kernel, dtype,
                       {"SWIGLU": False, "DOT": True, "IEEE": dtype == "fp32", "SPLIT": True, "INTERPRET": False,
                        "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 512, "LINE": 64, "PRELOAD": True, "NORM": norm,
                        "NORM_K": 1024}, pointers)
        before_wait, after_wait = ptx.split("griddepcontrol.wait")
        assert "ld.global" in before_wait and "st.global" not in before_wait  # the weights only, nothing written
        assert "rsqrt" in after_wait and "st.global" in after_wait  # the norm, and (NORM 2) h, after it


def compile_sampler(dtype: str) -> None:
    from engine.kernels import sampler

    pointers = {"logits_ptr": f"*{dtype}", "out_ptr": "*i64", "temperature_ptr": "*fp32", "top_k_ptr": "*i64",
                "top_p_ptr": "*fp32", "seed_ptr": "*i64", "counter_ptr": "*i64", "seen_ptr": "*i1",
                "penalty_ptr": "*fp32", "allow_eos_ptr": "*i1", "suppress_ptr": "*i1", "scratch_col_ptr": "*i32",
                "scratch_val_ptr": "*fp32"}
    for talker in (False, True):
        _compile(sampler._sample_rows, dtype, {"TALKER": talker, "BLOCK": 2048, "CHUNK": 256, "DIGIT_BITS": 4},
                 pointers)


def compile_codec(dtype: str) -> None:
    from engine.kernels import snake

    flags = ("HAS_BIAS", "HAS_RES", "STORE_X", "SNAKE", "CLAMP", "HAS_TIN", "HAS_TOUT", "TAIL_AT", "HAS_VALID")
    # a residual unit's first window in a stream step
    unit = ("HAS_BIAS", "HAS_RES", "STORE_X", "SNAKE", "HAS_TIN", "HAS_TOUT", "TAIL_AT")
    # FAST_SIN as window_config sets it: the polynomial below fp32, libdevice's sinf in fp32
    for on, block_c, block_t in (((), 128, 16), (flags, 128, 16), (unit, 2, 1024), (("HAS_BIAS", "CLAMP"), 1, 1024),
                                 (unit, 128, 64)):
        for fast_sin in {False, dtype != "fp32"}:
            _compile(snake._kernel(), dtype, {f: f in on for f in flags}
                     | {"BLOCK_C": block_c, "BLOCK_T": block_t, "FAST_SIN": fast_sin},
                     {"valid_ptr": "*i64", "tin_at_ptr": "*i64", "tout_at_ptr": "*i64"})
    from engine.kernels import codec_transformer

    norm, rope, ring = codec_transformer._kernels()
    for add in (True, False):
        _compile(norm, dtype, {"HAS_ADD": add, "BLOCK": 512})
    _compile(rope, dtype, {"HD": 64, "BLOCK": 64})
    for block_n in (32, 128):  # several rounds; the real codec's one
        _compile(ring, dtype, {"HD": 64, "BLOCK_D": 64, "BLOCK_T": 16, "BLOCK_N": block_n, "IEEE": dtype == "fp32"},
                 {"slots_ptr": "*i64", "pos_ptr": "*i64"})


def compile_cp_forward(dtype: str) -> None:
    from engine.kernels import cp_forward

    # launch_options() passes GDC to every kernel on CUDA (triton's interpreter ignores an unknown keyword)
    assert "GDC" in {p.name for p in cp_forward._cp_forward_kernel.params}
    pointers = {"bar_ptr": "*i32", "sumsq_ptr": "*fp32", "part_ptr": "*fp32", "ticket_ptr": "*i32", "slots_ptr": "*i64",
                "pos_ptr": "*i64"}
    geometry = {"L": 5, "H": 1024, "HQ": 16, "HKV": 8, "D": 128, "FF": 3072, "V": 2048, "BLOCK_K": 128,
                "BN_QKV": 32, "BN_RES": 16, "BN_UP": 32, "BN_HEAD": 16, "BLOCK_TILES": 64, "IEEE": dtype == "fp32",
                "BLOCK_C": 16, "SPIN_LIMIT": 1 << 16}
    # the Code Predictor's first forward at B1 (two tokens) and a later one at B64, in both modes
    for persistent, block_m, block_b, block_qm, block_t, split in ((True, 16, 16, 16, 2, 1), (False, 64, 64, 16, 2, 1),
                                                                   (True, 16, 16, 16, 2, 4)):
        ptx = _compile(cp_forward._cp_forward_kernel, dtype,
                       geometry | {"BLOCK_M": block_m, "BLOCK_B": block_b, "BLOCK_QM": block_qm, "BLOCK_T": block_t,
                                   "PERSISTENT": persistent, "SPLIT": split}, pointers, aligned=True)
        # the grid barrier: arrivals released, the wait acquired (an acquire load), at GPU scope; none without it
        assert ("atom.global.gpu.release" in ptx and "ld.global.gpu.acquire" in ptx) == persistent, persistent
        # one program per multiprocessor streams its weights only if its K loops are pipelined (async copies)
        assert "cp.async" in ptx


def compile_cp_stream(dtype: str) -> None:
    """The streamed forward at the real model's shapes over 132 programs and 8 warps (stream_forward's launch), at
    B1 (one row) and its first forward (two rows). Each barrier is a release arrival, relaxed polls and one acquire;
    between an arrival and its acquire the program reads the next weighted step's weights (attention's barrier:
    gate's, o's: up's), the reads ahead that the design is for, kept by the compiler; the activations are read
    after the acquire."""
    from engine.kernels import cp_stream

    cdiv = lambda n, d: -(-n // d)  # noqa: E731
    warps, chunk = 8, 256 if dtype == "bf16" else 128
    per = {"QKV": cdiv(4096, 132), "RES": cdiv(1024, 132), "UP": cdiv(3072, 132), "HEAD": cdiv(2048, 132)}
    geometry = {"L": 5, "H": 1024, "HQ": 16, "HKV": 8, "D": 128, "FF": 3072, "V": 2048, "BLOCK_QM": 16, "BLOCK_T": 2,
                "BLOCK_C": 16, "SPIN_LIMIT": 1 << 16, "IEEE": dtype == "fp32", "MARKS": 0, "LAYER_WEIGHTS": True,
                "KC": chunk, "C_H": 1024 // chunk, "ONE_TILE": True, "PREFETCH": True}
    geometry |= {f"CN_{k}": v for k, v in per.items()}
    geometry |= {f"BN_{k}": max(warps * (2 if k == "UP" else 1), triton.next_power_of_2(v)) for k, v in per.items()}
    (geometry["CA_O"], geometry["CB_O"]), (geometry["CA_FF"], geometry["CB_FF"]) = (
        cp_stream.chunks(2048, chunk), cp_stream.chunks(3072, chunk))
    pointers = {"bar_ptr": "*i32", "slots_ptr": "*i64", "pos_ptr": "*i64", "stamps_ptr": "*i64"}
    for rows in (1, 2) if dtype == "bf16" else (1,):  # B1's forwards after the first, and the first (two tokens)
        ptx = _compile(cp_stream._cp_stream_kernel, dtype, geometry | {"ROWS": rows, "ACQUIRE_POLL": False}, pointers,
                       aligned=True, warps=warps)
        arrivals = ptx.split("atom.global.gpu.release.add")[1:]
        assert len(arrivals) == 25  # one a barrier
        ahead = []
        for text in arrivals:
            waiting, acquired, _ = text.partition("ld.global.gpu.acquire")
            assert acquired and "ld.global.gpu.relaxed" in waiting
            ahead.append(sum("ld.global" in line and ".v4" in line for line in waiting.splitlines()))
        assert all(n > 0 for n in ahead), ahead
        # L2 hints for the weighted step after each read ahead: at the kernel's start and at each of the 25 barriers
        # but the last (the head's tile is the last read)
        hinted = [text.partition("ld.global.gpu.acquire")[0].count("prefetch.global.L2") > 0 for text in arrivals]
        assert hinted == [True] * 24 + [False] and "prefetch.global.L2" in ptx.split("atom.global.gpu.release")[0]
    # the probe's stamps (engine.tools.probe_cp_forward --stamps): a timer and a clock read at each mark, none without
    assert "%globaltimer" not in ptx and "%clock64" not in ptx
    marks = cp_stream.stamp_marks(5)
    probed = geometry | {"ROWS": 1, "ACQUIRE_POLL": False, "MARKS": marks, "GDC": 1, "PREFETCH": False}
    ptx = _compile(cp_stream._cp_stream_kernel, dtype, probed, pointers, aligned=True, warps=warps)
    assert ptx.count("%globaltimer") == ptx.count("%clock64") == marks and "prefetch" not in ptx


def _in_fresh_python(what: str, dtype: str) -> None:
    """Compile in a new interpreter without TRITON_INTERPRET: once the other kernel tests have run triton's
    interpreter in this process, its patched language objects break the real compiler."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[1]
    proc = subprocess.run([sys.executable, __file__, what, dtype], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_norm_kernels_compile(dtype):
    _in_fresh_python("norm", dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_attention_kernels_compile(dtype):
    _in_fresh_python("attention", dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_linear_kernel_compiles(dtype):
    _in_fresh_python("linear", dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sampler_kernel_compiles(dtype):
    _in_fresh_python("sampler", dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cp_forward_kernel_compiles(dtype):
    _in_fresh_python("cp_forward", dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cp_stream_kernel_compiles(dtype):
    _in_fresh_python("cp_stream", dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_codec_window_kernel_compiles(dtype):
    _in_fresh_python("codec", dtype)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))
    {"norm": compile_norm, "attention": compile_attention, "linear": compile_linear, "sampler": compile_sampler,
     "codec": compile_codec, "cp_forward": compile_cp_forward, "cp_stream": compile_cp_stream}[sys.argv[1]](sys.argv[2])
