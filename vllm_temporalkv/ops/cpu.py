"""The C++ CPU kernels (csrc/, module ``vllm_temporalkv._C_cpu``): loader, argument preparation, dispatch.

Ops (each the twin of the torch path in ``paged_torch``, which stays the oracle):

* ``decode_attention(lc, pages, query, key, value, seq_lens, block_tables, scale, out=None)``: fused
  paged attention straight from the codes for one query token per request, all requests in one call.
  Per (request, KV head, split): stream the blocks, decode each block's codes once through the
  centroid table, denormalize, outliers, RoPE on decoded keys, score all query heads of the GQA
  group, online softmax, accumulate V in normalized space (denormalized once at the end); split-K
  with a log-sum-exp merge.  Sinks, the tail, the new token and the own-block-exact rule as the
  torch path.  By default (the fast decode) keys are rotated per 64-token tile (DECODE_TILE) and decoded K/V are not
  rounded to the model dtype; ``exact=True`` computes decoded K/V exactly as the torch path computes them
  (bit-identical values before the dot products), so outputs agree with the float64 oracle to ~1e-6
  relative (see ``decode_attention``).
  QJL (seed 002): keys scored straight from their sign sketches (csrc method QJL: S q once per call, the block's
  outlier channels' share once per block, two signed sums per key; float32 rounding away from the torch path's
  surrogate keys, which it rounds to the model dtype), values decoded from their 2-bit codes, scale and min.
* ``gather_kv(lc, pages, block_table, n)``: the first n cached tokens -> (K post-RoPE, V), bit-identical
  to ``paged_torch.gather_kv`` (QJL's keys: its surrogates, to float32 rounding).
* ``write_kv(lc, pages, key, value, positions, page_ids)``: cache update, bit-identical pages to
  ``paged_torch.write_kv`` (exhaustive nearest-centroid search under the codec contract).
* ``nearest(vecs, centroids)``: the codec contract's argmin (registered for "cpu" tensors on load).
* ``paged_attention(...)``: the signature of ``paged_torch.paged_attention``; decode requests go to the
  fused kernel (unless ``batch_invariant``), the others to the prefill kernel on C++-gathered K/V.
* ``prefill_attention(...)``: a prefill chunk's attention (csrc/prefill_impl.h): its queries over the decoded
  context and their own blocks' exact keys in one pass, float32, GQA without K/V copies, chunk-invariant.
  On an AMX CPU a bf16 model's served chunks take ``cpu_flash.flash_prefill`` instead (``use_flash_prefill``).
* ``forward(...)``: a layer's step (attention + cache update), the backend's entry point; a prefill chunk
  is written first and its completed blocks read back decoded, so they are encoded once - write, read-back and
  attention in one C++ call (``_C.prefill_chunk`` on the C++ kernel, ``_C.prefill_chunk_flash`` on torch's flash
  kernel through ATen: each Python-dispatched op of a served step costs several times a warm one's).
* ``plan_step(...)`` -> ``StepPlan``: what every layer of a step derives from its metadata alone (host lists, int32
  tables, small pages' exact-page numbers), derived by the step's first layer.

If the extension cannot be loaded, ``available()`` is False, a warning says so once, and every op
here falls back to the torch path.  ``VLLM_TEMPORALKV_CPU_ISA=avx512|avx2|scalar`` forces a kernel
variant (default: the best the CPU has); ``VLLM_TEMPORALKV_CPU_JIT=1`` compiles csrc/ with
``torch.utils.cpp_extension.load`` when the built extension is missing (a checkout only);
``VLLM_TEMPORALKV_CPU_EXACT=1`` makes the decode kernel's slower, bit-matched variant the default.
``VLLM_TEMPORALKV_CPU_BF16_DOT=0`` keeps a bf16 model's prefill scores and value sums in float32 FMAs on an
AVX512_BF16 CPU.
``VLLM_TEMPORALKV_CPU_PREFILL=flash|kernel|auto`` picks a served prefill chunk's attention: torch's flash kernel
(``cpu_flash``: bf16 GEMMs on AMX tiles, bf16-rounded) or the C++ kernel (chunk-invariant); auto (default): flash
for a bf16 model on a CPU with AMX unless VLLM_TEMPORALKV_CPU_EXACT=1 (``use_flash_prefill``).
``VLLM_TEMPORALKV_CPU_AMX_SHORT=0`` keeps a short chunk (a prefix-cache hit's new tokens: ``cpu_flash.short_mask``) on
flash and the merge instead of the AMX tile kernel (csrc/amx_attention.h) where the flash path serves;
``VLLM_TEMPORALKV_CPU_AMX_LONG=0`` likewise a long chunk (a prompt's prefill chunks: the flash-style tile kernel), and
every chunk of a recent window's formats (``amx_prefill_ok``), which the same kernel serves.
``VLLM_TEMPORALKV_CPU_AMX_EMULATE=1`` runs those tile kernels emulated in AVX512-BF16 (csrc/amx_emulate.h;
``set_amx_emulated``) where the flash path serves (``VLLM_TEMPORALKV_CPU_PREFILL=flash`` on a CPU without tiles): for
testing them there - slower than the C++ kernel, never a default.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import weakref
from pathlib import Path

import torch

from . import paged_torch
from ..layout import TAIL_SLOT0, exact_from
from ..methods import BLOCK_TOKENS, KERNEL_SCALAR, SINK_TOKENS
from ..cpu_isa import cpu_class
from ..page_views import region_view
from .cpu_flash import _flash_gqa, flash_prefill, register_window_merge, short_mask

logger = logging.getLogger("vllm.temporalkv")

ABI_VERSION = 22  # csrc/ops.cpp's ABI_VERSION this module's calls are written for
# split-K: every request's context is cut at the same tile boundaries whatever the batch, so its output does
# not depend on which requests share the step (a batch-dependent split count changed float32 rounding, and a
# 2-bit cache amplifies that through the codes of later tokens: benchmarks/stress.py).  Long splits cost less
# (each split zeroes, rescales and reduces its accumulators: 1024 tokens decode ~10% faster than 256 at batch 8,
# 4k tokens, 2 threads); short ones keep many threads busy on one long request.  Fixed per process.
DECODE_TILE = 64  # tokens per decode tile: csrc/common.h DTILE (since ABI_VERSION 11)
SPLIT_TILES = (1024 if torch.get_num_threads() <= 4 else 512 if torch.get_num_threads() <= 16 else 256) // DECODE_TILE
# decode_attention's default: the fast decode, unless VLLM_TEMPORALKV_CPU_EXACT=1 (see there)
EXACT = os.environ.get("VLLM_TEMPORALKV_CPU_EXACT") == "1"
# a served prefill chunk's attention (use_flash_prefill): auto, flash or kernel
PREFILL = os.environ.get("VLLM_TEMPORALKV_CPU_PREFILL", "auto")
# a short chunk of the flash path on AMX tiles (csrc/amx_attention.h) where the CPU and OS allow (_C.amx_ready)
AMX_SHORT = os.environ.get("VLLM_TEMPORALKV_CPU_AMX_SHORT", "1") != "0"
# a long chunk (a prompt's prefill chunks) likewise on AMX tiles, flash-style (csrc/amx_attention.h long_panel)
AMX_LONG = os.environ.get("VLLM_TEMPORALKV_CPU_AMX_LONG", "1") != "0"
if PREFILL not in ("auto", "flash", "kernel"):
    raise ValueError(f"VLLM_TEMPORALKV_CPU_PREFILL={PREFILL!r}: expected auto, flash or kernel (unset: auto)")

_SCALED, _TADA, _AFFINE = 3, 4, 5  # csrc/common.h Methods SCALED, TADA, AFFINE: scaled integer codes (no codebook)
_QJL = 6  # csrc/common.h Method QJL: QJL's key sketches (scored, never decoded)
_C = None
_LOAD_ERROR: str | None = None
_WARNED = False


def _jit_load():
    from torch.utils.cpp_extension import load

    src = Path(__file__).resolve().parents[2] / "csrc"
    if not src.is_dir():
        raise ImportError(f"no csrc/ next to the package ({src})")
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    units = ["ops.cpp", "isa_scalar.cpp"] + (["isa_avx2.cpp", "isa_avx512.cpp", "isa_amx.cpp", "isa_amx_emu.cpp"]
                                             if x86 else [])  # setup.py's
    return load(name="vllm_temporalkv_C_cpu", sources=[str(src / u) for u in units],
                extra_include_paths=[str(src)],
                extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
                + (["-DTKV_X86=1"] if x86 else []),
                extra_ldflags=["-fopenmp"], verbose=False)


def _load():
    global _C, _LOAD_ERROR
    try:
        from .. import _C_cpu as mod
    except Exception as e:  # noqa: BLE001 - any failure means: torch path
        mod = None
        _LOAD_ERROR = f"{type(e).__name__}: {e}"
        if os.environ.get("VLLM_TEMPORALKV_CPU_JIT") == "1":
            try:
                mod = _jit_load()
                _LOAD_ERROR = None
            except Exception as e2:  # noqa: BLE001
                _LOAD_ERROR += f"; JIT build failed: {type(e2).__name__}: {e2}"
    if mod is not None and (getattr(mod, "ABI_VERSION", None) != ABI_VERSION
                            or getattr(mod, "DECODE_TILE", None) != DECODE_TILE):
        _LOAD_ERROR = (f"{getattr(mod, '__file__', mod)} is a stale build (ABI {getattr(mod, 'ABI_VERSION', None)}, "
                       f"decode tile {getattr(mod, 'DECODE_TILE', None)}; this package expects {ABI_VERSION}, "
                       f"{DECODE_TILE})")
        mod = None
    _C = mod
    if _C is not None:
        from ..codecs.base import register_nearest

        register_nearest("cpu", nearest)
        register_window_merge(_C.window_merge)


def available() -> bool:
    """Whether the C++ kernels are loaded; if not, warns once (callers use the torch path)."""
    global _WARNED
    if _C is None and not _WARNED:
        _WARNED = True
        logger.warning(
            "vllm-temporalkv: the C++ CPU kernels (vllm_temporalkv._C_cpu) could not be loaded (%s); "
            "attention and cache updates run on the slower torch path. Rebuild with "
            "`pip install --no-build-isolation -e . --no-deps` (needs a C++ compiler and torch).", _LOAD_ERROR)
    return _C is not None


def isa() -> str | None:
    """The kernel variant in use ("avx512", "avx2", "scalar"), None without the extension."""
    return _C.isa() if _C is not None else None


def gathers() -> bool | None:
    """Whether the AVX-512 decode reads channel codes with vpgather (where the CPU's gathers are not slowed by the
    Gather Data Sampling mitigation; VLLM_TEMPORALKV_CPU_GATHERS=0|1 overrides), None without the extension."""
    return bool(_C.gathers()) if _C is not None else None


def set_gathers(on: bool) -> None:
    """Force the AVX-512 decode's code reads (tests): vpgather (True) or scalar loads (False); the same values."""
    _C.set_gathers(bool(on))


def encode_f32_blocks() -> int | None:
    """Blocks per KV head from which a C++ encode searches the codebooks' float32 tables instead of their float16
    copy (csrc/ops.cpp encode_blocks; the same codes either way); None without the extension."""
    return int(_C.encode_f32_blocks()) if _C is not None else None


def set_encode_f32_blocks(blocks: int) -> None:
    """Set it (0: always float32; a count above any call's blocks: always float16) - benchmarks/encode_cpu.py."""
    _C.set_encode_f32_blocks(int(blocks))


def amx_emulated() -> bool | None:
    """Whether the AMX tile kernels run emulated in AVX512-BF16 (csrc/amx_emulate.h; tests on CPUs without tiles,
    or VLLM_TEMPORALKV_CPU_AMX_EMULATE=1), None without the extension."""
    return bool(_C.amx_emulated()) if _C is not None else None


def set_amx_emulated(on: bool) -> None:
    """Run the AMX tile kernels emulated (True) - the same code, each tile instruction in AVX512-BF16, so that they
    run and are tested where the CPU has no tiles - or on the tiles (False).  Refused without AVX512-BF16."""
    _C.set_amx_emulated(bool(on))


def supported_isas() -> list[str]:
    return list(_C.supported_isas()) if _C is not None else []


def set_isa(name: str) -> None:
    """Force a kernel variant (tests); raises if the CPU cannot run it."""
    global _BF16_UNITS
    _C.set_isa(name)
    _BF16_UNITS = None  # whether the variant takes bf16 scores: asked again


# ---- what the kernels need from a LayerCache, prepared once per (quantizer, layout) ------------

_CODEC: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _codec_args(q, lay, kind: str, H: int):
    per = _CODEC.setdefault(q, {})
    key = (kind, lay.kind_code_bytes[kind], lay.k_codes, lay.v_codes, lay.k_idx, lay.k_val, lay.v_idx, lay.v_val,
           lay.k_scales, lay.v_scales, H)
    if key not in per:
        cl = q.code_layout
        offs = [lay.kind_code_bytes[kind],  # a K/V pair's halves differ (the kernels read each with its own codec)
                lay.k_codes if kind == "k" else lay.v_codes,
                lay.k_idx if kind == "k" else lay.v_idx,
                lay.k_val if kind == "k" else lay.v_val,
                lay.k_scales if kind == "k" else lay.v_scales]
        D = lay.head_dim
        none = torch.empty(0)
        if cl is None:  # QJL's key sketches (cache.blocker(sketches=True)): sketch sizes m, m_o and S^T [D, m]
            ints = [_QJL, q.m, 1, q.m_o, *offs, 0, 0, 0, 0, 0]
            per[key] = ([q.S.t().contiguous(), none, torch.zeros(H, D), torch.ones(H, D), torch.ones(H, D),
                         torch.zeros(H, D), torch.zeros(H, D), none.half(), none, none, none, none.half()], ints)
            return per[key]
        if cl.kernel_variant is None:  # scaled integer codes (cache.blocker(scaled=True)): no codebook, raw values
            if cl.cpu_scaled == "tada":  # + where the head mean's shares sit, channels per share and per scale group
                ints = [_TADA, 1, cl.code_bits, cl.n_centroids, *offs, 0, lay.k_mean if kind == "k" else lay.v_mean,
                        lay.mean_channels, min(cl.scale_group, D), 0]
            elif cl.cpu_scaled == "affine":  # + channels per scale group
                ints = [_AFFINE, 1, cl.code_bits, cl.n_centroids, *offs, 0, 0, 0, min(cl.scale_group, D), 0]
            else:  # selective: + the code of 0
                ints = [_SCALED, 1, cl.code_bits, cl.n_centroids, *offs, q.codec.qmax + 1, 0, 0, 0, 0]
            tensors = [none, none, torch.zeros(H, D), torch.ones(H, D), torch.ones(H, D), torch.zeros(H, D),
                       torch.zeros(H, D), none.half(), none, none, none, none.half()]
            per[key] = (tensors, ints)
            return per[key]
        codec, s = q.codec, q.stats
        f32 = lambda t: t.detach().float().contiguous().cpu()  # noqa: E731
        cent = f32(codec._check_fitted())
        variant = cl.kernel_variant  # from the code layout's geometry (layout.CodeLayout)
        scalar = variant == KERNEL_SCALAR
        # float16 copy: the attention kernel's lookup tables (half the cache footprint; artifacts store
        # fp16 centroids, so this is exact for them); the encode uses the float32 ones, the gather (bit-exact) the
        # float16 ones only where they are exact (half_exact: the last int)
        half_exact = int(torch.equal(cent.half().float(), cent))
        ints = [variant, 1 if scalar else codec.chunk, (codec.n_centroids - 1).bit_length() if scalar else 8,
                codec.n_centroids, *offs, 0, 0, 0, 0, half_exact]
        tensors = [cent, cent.transpose(2, 3).contiguous(), f32(s.mean), f32(s.std), f32(s.inv_std), f32(s.lo),
                   f32(s.hi), cent.half().contiguous(),
                   # scalar method: [H, KC, D], a codebook entry of every channel side by side (vector loads)
                   cent.permute(0, 2, 1, 3).contiguous() if scalar else cent,
                   # vector methods: each centroid's squared norm [H, G, KC] (and below each codebook's largest):
                   # the encode's screen (kernels_impl.h nearest_screen)
                   torch.empty(0) if scalar else (cent * cent).sum(-1).contiguous()]
        tensors.append(torch.empty(0) if scalar else tensors[-1].amax(-1).contiguous())  # [H, G]; NaN propagates
        # vector methods, fp16-exact centroids: the encode's table in float16 (the same values in half the bytes of
        # its largest table, which a served layer step reads from DRAM)
        tensors.append(tensors[1].half() if half_exact and not scalar else torch.empty(0, dtype=torch.half))
        per[key] = (tensors, ints)
    return per[key]


def _layout_args(lc, H: int) -> list[int]:
    lay = lc.layout
    model = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[lc.dtype]
    return [H, lay.head_dim, lay.block_size, lay.cap, lay.bytes, int(lc.store_dtype == torch.bfloat16), model,
            lay.window]


_ARGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer cache -> {H: its kernel arguments}


def _args(lc, H: int):
    """The kernels' codec and layout arguments of a layer cache, built once per (layer cache, heads): every decode
    step of every layer asks (rebuilding them was ~1/10 of a short-context decode step's Python)."""
    per = _ARGS.setdefault(lc, {})
    if H not in per:
        kt, ki = _codec_args(lc.k, lc.layout, "k", H)
        vt, vi = _codec_args(lc.v, lc.layout, "v", H)
        per[H] = (kt, ki, vt, vi, _layout_args(lc, H))
    return per[H]


_ROPE: dict = {}  # shared by every layer's Rope with the same frequencies and scale
_ROPE_KEY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Rope -> its key in _ROPE


def rope_tables(rope, n: int):
    """cos, sin [P >= n, D/2] float32 for positions 0..P-1, from ``Rope.cos_sin`` itself (bit-identical
    to the torch path; channels c and c + D/2 share their values), and the same transposed [D/2, P]
    (the decode kernel's).  Grows by powers of two."""
    key = _ROPE_KEY.get(rope)
    if key is None:  # (a Rope's frequencies do not change: its key once, not a device copy per call)
        key = _ROPE_KEY[rope] = (float(rope.scale), rope.inv_freq.detach().float().cpu().numpy().tobytes())
    have = _ROPE.get(key)
    if have is None or have[0].shape[0] < n:
        P = max(1024, 1 << max(0, int(n) - 1).bit_length())
        cos, sin = rope.cos_sin(torch.arange(P, device=rope.inv_freq.device))
        hd = cos.shape[-1] // 2
        cos, sin = cos[:, 0, :hd].float().contiguous().cpu(), sin[:, 0, :hd].float().contiguous().cpu()
        T = DECODE_TILE
        have = (cos, sin, cos.t().contiguous(), sin.t().contiguous(),  # exact decode: per position
                cos[::T].contiguous(), sin[::T].contiguous(),  # fast decode: tile starts, offsets
                cos[:T].t().contiguous(), sin[:T].t().contiguous())
        _ROPE[key] = have
    return have


def supports(lc, pages: torch.Tensor | None = None) -> bool:
    """Whether the kernels read this layer cache's pages (decode attention, gather; else: the torch path).  Writes
    are ``encodes``'s question."""
    if not (available() and _static_support(lc)):
        return False
    if pages is None or _PAGES_OK.get(lc) is pages:  # (a served layer's one pages tensor: checked once)
        return True
    ok = pages.device.type == "cpu" and pages.dtype == torch.uint8 and pages.is_contiguous()
    if ok:
        _PAGES_OK[lc] = pages
    return ok


# layer cache -> the last pages tensor supports() found readable (a tensor's device, dtype and layout do not change)
_PAGES_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_SUPPORT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer cache -> the kernels read and write it


def _static_support(lc) -> bool:
    """What ``supports`` and ``encodes`` decide from the layer cache alone (a frozen one: decided once): codebook
    codes, the selective formats', TaDA's and QJL's scaled ones and QJL's key sketches, with or without a recent
    window (lc.blocker: what the layer cache says these kernels cannot decode), read and written (csrc/ops.cpp
    encode_args) alike."""
    have = _SUPPORT.get(lc)
    if have is None:
        D = lc.layout.head_dim
        have = _SUPPORT[lc] = (lc.blocker(scaled=True, window=True, sketches=True) is None
                               and lc.dtype in (torch.bfloat16, torch.float16, torch.float32) and D % 32 == 0
                               and D <= 256)
    return have


def attends(lc) -> bool:
    """Whether a prefill chunk's attention over decoded and exact K/V arrays (``attend_fast``: flash or the C++
    prefill kernel) serves this layer cache (QJL: its keys' surrogates k_hat, the chunk attends to them like to any
    format's decoded keys)."""
    D = lc.layout.head_dim
    return available() and lc.dtype in (torch.bfloat16, torch.float16, torch.float32) and D % 32 == 0 and D <= 256


def encodes(lc, pages: torch.Tensor | None = None, heads: int | None = None) -> bool:
    """Whether ``write_kv`` / ``write_kv_window`` encode in C++: every format the kernels read (codebook codes, the
    selective formats', TaDA's - its head mean over at most 16 KV heads: the order torch sums them in -, QJL's sign
    sketches under their float64 contract and its values' affine codes), with or without a recent window."""
    return supports(lc, pages) and (heads is None or heads <= 16 or "tada" not in (
        getattr(lc.k.code_layout, "cpu_scaled", None), getattr(lc.v.code_layout, "cpu_scaled", None)))


_NONE32, _NONE64 = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)  # no small pages
_NO_MASK = torch.empty(0)  # prefill_chunk_flash: a chunk not short enough for one masked call


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


# ---- ops ---------------------------------------------------------------------------------------


def num_splits(max_tiles: int, split_tiles: int = SPLIT_TILES) -> int:
    """Splits per (request, KV head) of a batch whose longest context has max_tiles tiles."""
    return max(1, -(-max_tiles // split_tiles))


# (decode_attention and write_kv without torch.no_grad: their outputs are written by C++, nothing autograd could
# record but a few conversions, and one more grad-mode switch per call cost ~1 us of each layer's decode step)
def decode_attention(lc, pages: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, *, split_tiles: int = SPLIT_TILES,
                     exact: bool | None = None, small=None, max_len: int | None = None,
                     exact_table32: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per request: query [R, Hq, D], this step's key/value [R, Hkv, D], seq_lens [R]
    (cached + the new token), block_tables [R, P].  Reads the pages before this step's write_kv.

    exact (default ``EXACT``: False unless VLLM_TEMPORALKV_CPU_EXACT=1): decoded K/V are computed as the torch
    path computes them (the same float32 ops and per-position RoPE tables, then rounded to the model dtype), so
    outputs match its float64 attention to ~1e-6.  exact=False (the fast decode, ~1.4x faster on a bf16 model):
    temporal keys decoded, denormalized and rotated as R(tile start) R(offset) in one pass, temporal values
    accumulated in normalized space, and K/V not rounded to the model dtype - a different rounding of the decoded
    values, up to ~1% on single output elements of a real bf16 model (large logits amplify the model-dtype
    rounding of the keys); a float32 model has no such rounding, and both agree to float32 rounding (~1e-6).

    small: small pages' exact pages (``paged_torch.ExactPages``, its table's rows these requests').  max_len (the
    largest seq_len) and exact_table32 (small's table's first two columns, int32): a step plan's, where it has them
    (else derived here)."""
    R, Hq, D = query.shape
    H = key.shape[1]
    if out is None:
        out = torch.empty_like(query)
    if R == 0:
        return out
    if not supports(lc, pages):
        qsl = torch.arange(R + 1, device=query.device)
        return paged_torch.paged_attention(lc, pages, query, key, value, qsl, seq_lens, block_tables, scale,
                                           out, batch_invariant=False, exact=small)
    sl = _i32(seq_lens)
    bt = _i32(block_tables)
    if max_len is None:
        max_len = int(sl.max())
    cosT, sinT, tcos, tsin, dcos, dsin = rope_tables(lc.rope, max_len + DECODE_TILE)[2:]
    if exact is None:
        exact = EXACT
    # the new K/V as the cache holds them (``lc.exact``'s values: the stored half, which the kernel widens), the
    # query and out as they are: the kernel converts them, and reads rows strided as a fused qkv projection's split
    # leaves them (each .float().contiguous() here cost ~2 us of a step's glue per layer)
    query, kh, vh = _rows(query), _rows(_stored(lc, key)), _rows(_stored(lc, value))
    o = out if out.is_contiguous() else torch.empty(R, Hq, D, dtype=out.dtype)
    kt, ki, vt, vi, li = _args(lc, H)
    xp = _NONE32 if small is None else exact_table32 if exact_table32 is not None else _i32(small.table[:, :2])
    _C.decode_attention(pages, query, kh, vh, sl, bt, cosT, sinT, o, kt, ki, vt, vi, li, float(scale),
                        int(split_tiles), bool(exact), tcos, tsin, dcos, dsin, 1.0 / float(lc.rope.scale), xp)
    if o is not out:
        out.copy_(o)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] with each token's values contiguous (the tokens' rows may be strided: a split of vLLM's QKV
    projection, read in place), as the decode kernel and the cache writes read it."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _stored(lc, x: torch.Tensor) -> torch.Tensor:
    """New keys / values as the cache stores their exact values (``lc.store_dtype``): ``lc.exact(x)`` widened is
    this widened, whatever x's dtype (the model's half dtype is the store's; a float32 model stores bfloat16)."""
    store = lc.store_dtype
    return x if x.dtype == store else x.to(store)


@torch.no_grad()
def gather_kv(lc, pages: torch.Tensor, block_table: torch.Tensor, n: int, exact=None):
    """The first n cached tokens of one sequence -> (K post-RoPE, V) [n, H, D] in lc.dtype, bit-identical
    to ``paged_torch.gather_kv`` (QJL's keys: its surrogates k_hat summed in another order, within float32 rounding
    of the torch path's before the model dtype's); ``exact``: small pages' (region, sink page, ring page) as there."""
    if not supports(lc, pages):
        return paged_torch.gather_kv(lc, pages, block_table, n, exact=exact)
    H = pages.shape[1]
    cos, sin = rope_tables(lc.rope, max(int(n), 1))[:2]
    sink, ring = (-1, -1) if exact is None else (int(exact[1]), int(exact[2]))
    return tuple(_C.gather(pages, _i32(block_table), int(n), cos, sin, *_args(lc, H), sink, ring))


def write_kv(lc, pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
             page_ids: torch.Tensor, exact=None, max_pos: int | None = None) -> None:
    """Twin of ``paged_torch.write_kv`` (same arguments, bit-identical pages; ``max_pos``: the largest position,
    where the caller knows it - a step plan's - else read from ``positions``)."""
    if key.shape[0] == 0:
        return
    if not encodes(lc, pages, key.shape[1]):
        return paged_torch.write_kv(lc, pages, key, value, positions, page_ids, exact=exact)
    if lc.layout.exact_pages != (exact is not None):
        raise ValueError("small pages are written with their exact pages, other layouts without")
    sinks, rings = (_NONE64, _NONE64) if exact is None else (_i64(exact[1]), _i64(exact[2]))
    pos, pid = _i64(positions), _i64(page_ids)
    cos, sin = rope_tables(lc.rope, (int(pos.max()) if max_pos is None else max_pos) + 1)[:2]
    kh, vh = _rows(_stored(lc, key)), _rows(_stored(lc, value))
    _C.write_kv(pages, kh, vh, pos, pid, cos, sin, float(lc.rope.scale) ** 2, *_args(lc, key.shape[1]), sinks, rings)


def write_kv_window(lc, pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Twin of ``paged_torch.write_kv_window`` (same arguments, bit-identical pages): a prefill's blocks and a decode
    step's alike in one C++ call (the torch path's window glue, ~15 small ops per request, cost a selective or TaDA
    prefill ~2x the C++ codebook write)."""
    if key.shape[0] == 0:
        return
    if not encodes(lc, pages, key.shape[1]):
        return paged_torch.write_kv_window(lc, pages, key, value, query_start_loc, seq_lens, block_tables)
    lens = seq_lens.to(torch.int64).contiguous()
    cos, sin = rope_tables(lc.rope, int(lens.max()))[:2]
    _C.write_kv_window(pages, _rows(_stored(lc, key)), _rows(_stored(lc, value)),
                       query_start_loc.to(torch.int64).contiguous(), lens, _i32(block_tables), cos, sin,
                       float(lc.rope.scale) ** 2, *_args(lc, key.shape[1]))


def nearest(vecs: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """vecs [B, N, v], centroids [B, K, v] -> [B, N] int64: the exact argmin of ``codecs.base``
    (float32 distances summed in order without FMA, ties to the lowest index)."""
    if _C is None or vecs.device.type != "cpu":
        from ..codecs.base import nearest_torch

        return nearest_torch(vecs.float(), centroids.float())
    return _C.nearest(vecs.float().contiguous(), centroids.float().transpose(1, 2).contiguous())


@torch.no_grad()
def paged_attention(
    lc,
    pages: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    batch_invariant: bool = True,
    exact=None,
    plan: StepPlan | None = None,
) -> torch.Tensor:
    """Drop-in for ``paged_torch.paged_attention`` (same signature and semantics; ``exact``: small pages'
    ``paged_torch.ExactPages``; ``plan``: the step's ``StepPlan``, derived here when not given).

    Requests with one query token go to the fused decode kernel in one call (float32; with
    ``batch_invariant`` they stay on the float64 torch attention, whose result does not depend on
    batching); the others (prefill chunks) attend with the C++ prefill kernel (``attend_fast``) on K/V
    gathered by the C++ decoder (bit-identical to the torch gather)."""
    if not supports(lc, pages):
        return paged_torch.paged_attention(lc, pages, query, key, value, query_start_loc, seq_lens,
                                           block_tables, scale, out, batch_invariant, exact=exact)
    if out is None:
        out = torch.empty_like(query)
    if batch_invariant:
        rest = list(range(seq_lens.shape[0]))
    else:
        if plan is None:
            plan = plan_step(query_start_loc, seq_lens, block_tables=block_tables)
        _attend_decodes(lc, pages, query, key, value, plan, scale, out, exact,
                        None if exact is None else plan.exact_plan(exact))
        rest = plan.prefills
    if rest:  # prefill chunks: the C++ prefill kernel on K/V the C++ decoder gathered
        paged_torch.paged_attention(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, scale,
                                    out, batch_invariant, requests=rest, gather=gather_kv, exact=exact,
                                    attend_fast=attend_fast)
    return out


def _own_block(p: int, window: int = 0) -> int:
    """Where a query at p starts reading keys exact: its own block (block 0, the sinks, for p < 8; the sinks are
    exact in the gather too), or ``window`` tokens before it (``paged_torch._window_start``) - csrc's exact_start."""
    if p < SINK_TOKENS or p - window < 0:
        return 0
    return (p - window) // BLOCK_TOKENS * BLOCK_TOKENS


def attend_fast(q, k_exact, v_exact, k_dec, v_dec, scale, offset, window: int = 0):
    """``paged_torch._attend_fast``'s twin (its arguments: full-length exact and decoded K/V) on the C++ prefill
    kernel, or on torch's flash kernel where a served chunk would be (``use_flash_prefill``)."""
    x = _own_block(offset, window)
    n = offset + q.shape[0]
    if use_flash_prefill(q.dtype):  # as a served chunk (_prefill)
        return flash_prefill(q, k_dec, v_dec, k_exact[x:n], v_exact[x:n], x, offset, scale, window=window)
    return prefill_attention(q, k_dec, v_dec, k_exact[x:n], v_exact[x:n], x, offset, scale, window=window)


@dataclasses.dataclass
class StepPlan:
    """What a step's layers all derive from its metadata alone, derived once per step (``plan_step``: the backend
    builds it with the step's first layer and hands it to the others, ``TemporalKVMetadata.plan``).  At batch 1 a
    step's attention layers spent ~1/3 of their time on this Python (a prefix-cache hit's 40-token chunk on the
    2-core AMX Xeon, benchmarks/prefix): the host lists, int32 tables and small pages' exact-page numbers below."""

    qsl: list[int]  # query_start_loc
    lens: list[int]  # seq_lens
    decodes: list[int]  # the requests with one query token
    prefills: list[int]  # the others
    seq_lens32: torch.Tensor  # int32, contiguous: the decode kernel's
    tables32: torch.Tensor  # block tables, int32, contiguous (rows: a gather's)
    max_len: int = 0  # the largest seq_len
    rows: torch.Tensor | None = None  # the decodes' query rows and request indices (None: every request a decode)
    ridx: torch.Tensor | None = None
    _exact: dict = dataclasses.field(default_factory=dict)  # small pages: what exact_plan derived, per exact table

    def exact_plan(self, exact) -> dict:
        """Small pages' per-step values of ``exact`` (``paged_torch.ExactPages``: this step's exact table, shared
        by the layers): its rows as ints, its (sink, ring) columns for the decodes (and ``exact_tokens``: each
        token's pages).  Keyed by the table's identity, which lives as long as the step (its metadata holds it), as
        this plan does."""
        got = self._exact.get(id(exact.table))
        if got is None or got["table"] is not exact.table:
            t = exact.table[:, :2]
            got = {"table": exact.table, "ints": t.tolist(), "decode": _i32(t if self.rows is None else t[self.ridx])}
            self._exact[id(exact.table)] = got
        return got

    def exact_tokens(self, exact, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``exact.tokens`` of the step's n tokens (region, sink page [n], ring page [n]), once per step."""
        got = self.exact_plan(exact)
        if got.get("n") != n:  # (the pages only: the region is each layer's own)
            got["n"], got["tokens"] = n, exact.tokens(torch.tensor(self.qsl), n)[1:]
        return (exact.region, *got["tokens"])


def plan_step(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, device=None, table_device=None,
              device_seq_lens=None, block_tables: torch.Tensor | None = None, block_size: int | None = None) -> StepPlan:
    """A step's ``StepPlan`` from its host metadata (the arguments of ``triton_path.plan_step``; the CPU's needs
    the block tables)."""
    qsl = query_start_loc.tolist()
    R = seq_lens.shape[0]
    dec = [r for r in range(R) if qsl[r + 1] - qsl[r] == 1]
    lens = seq_lens.tolist()
    plan = StepPlan(qsl, lens, dec, [r for r in range(R) if qsl[r + 1] - qsl[r] > 1], _i32(seq_lens),
                    _NONE32 if block_tables is None else _i32(block_tables), max(lens, default=0))
    if not (R > 0 and len(dec) == R and qsl[-1] == R):  # not every row a decode: the decodes' rows
        plan.rows = torch.tensor([qsl[r] for r in dec], dtype=torch.long)
        plan.ridx = torch.tensor(dec, dtype=torch.long)
    return plan


@torch.no_grad()
def forward(lc, pages: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
            positions: torch.Tensor, page_ids: torch.Tensor, scale: float, out: torch.Tensor | None = None,
            batch_invariant: bool = True, plan: StepPlan | None = None, exact=None) -> torch.Tensor:
    """Twin of ``paged_torch.forward`` (a layer's step: attention, then the cache update; ``plan``: the step's
    ``StepPlan``, derived here when not given).

    Decode requests: the fused decode kernel on the pages as they were, then their tokens are written.
    Prefill chunks (without ``batch_invariant``) write first and read back: the blocks a chunk
    completes are encoded once, by ``write_kv``, and the attention reads their codes decoded by
    ``gather_kv`` - the same values the torch path gets by encoding and decoding them itself (it must
    attend first). Only the exact values of the context's incomplete block are read before the write,
    which may reuse their tail slots.  With a recent window (``write_kv_window``; not on small pages) the same
    order: a chunk's ring rows are read before its write, the decodes' window update comes last."""
    if not supports(lc, pages) or batch_invariant:  # the torch path; a prefill chunk's attention on K/V arrays
        return paged_torch.forward(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables,  # is
                                   positions, page_ids, scale, out, batch_invariant, exact=exact,  # any format's
                                   attend_fast=attend_fast if not batch_invariant and attends(lc)
                                   and pages.device.type == "cpu" else None)
    window = lc.layout.window and exact is None
    if out is None:
        out = torch.empty_like(query)
    if plan is None:
        plan = plan_step(query_start_loc, seq_lens, block_tables=block_tables)
    ex = None if exact is None else plan.exact_plan(exact)
    _attend_decodes(lc, pages, query, key, value, plan, scale, out, exact, ex)
    qsl, N = plan.qsl, query.shape[0]
    for r in plan.prefills:
        a, b = qsl[r], qsl[r + 1]
        pg = None if exact is None else (exact.region, *ex["ints"][r])
        if a == 0 and b == N == positions.shape[0] == page_ids.shape[0]:  # the step's only request (a prefix-cache
            # hit's chunk, a prompt's): the tensors as they are, no slices
            _prefill(lc, pages, query, key, value, positions, page_ids, plan.tables32[r], plan.lens[r], scale, out,
                     pg)
        else:
            _prefill(lc, pages, query[a:b], key[a:b], value[a:b], positions[a:b], page_ids[a:b], plan.tables32[r],
                     plan.lens[r], scale, out[a:b], pg)
    if not plan.decodes:  # prefill chunks only: each wrote its own tokens
        return out
    rows = plan.rows
    if window:  # the decodes' window update (all of them at once)
        if rows is None:
            write_kv_window(lc, pages, key, value, query_start_loc, seq_lens, block_tables)
        else:
            write_kv_window(lc, pages, key[rows], value[rows], torch.arange(rows.numel() + 1), seq_lens[plan.ridx],
                            block_tables[plan.ridx])
        return out
    tok = None if exact is None else plan.exact_tokens(exact, key.shape[0])  # (region, sink [N], ring [N])
    if rows is None:  # every request a decode: its positions are its seq_lens - 1
        write_kv(lc, pages, key, value, positions, page_ids, exact=tok, max_pos=plan.max_len - 1)
    else:
        write_kv(lc, pages, key[rows], value[rows], positions[rows], page_ids[rows],
                 exact=None if tok is None else (tok[0], tok[1][rows], tok[2][rows]))
    return out


def _attend_decodes(lc, pages, query, key, value, plan: StepPlan, scale, out, exact=None, ex=None) -> None:
    """The requests with one query token attend in one fused decode call (before any write of the step), into out.
    ``ex``: ``plan.exact_plan(exact)`` (small pages)."""
    if not plan.decodes:
        return
    xp = None if ex is None else ex["decode"]
    if plan.rows is None:  # every request a decode: no per-request Python
        decode_attention(lc, pages, query, key, value, plan.seq_lens32, plan.tables32, scale, out, small=exact,
                         max_len=plan.max_len, exact_table32=xp)
        return
    rows, ridx = plan.rows, plan.ridx
    small = None if exact is None else dataclasses.replace(exact, table=exact.table[ridx])
    out[rows] = decode_attention(lc, pages, query[rows], key[rows], value[rows], plan.seq_lens32[ridx],
                                 plan.tables32[ridx], scale, small=small, max_len=max(plan.lens[r] for r in plan.decodes),
                                 exact_table32=xp).to(out.dtype)


def _prefill(lc, pages, q, k, v, positions, page_ids, table, n: int, scale: float, out: torch.Tensor,
             exact=None) -> None:
    """One request's chunk of new tokens (positions n - len(q) .. n - 1): write, then attend.  ``exact``: small
    pages' (region, sink page, ring page) of this request, the pages as ints (``ExactPages.request_pages``).

    With a recent window of w tokens (pages written by the torch path, read by the C++ gather) the same with
    everything w positions back: the context's exact rows the first query reads (its ring, [lo, ctx)) are read
    before the write, which may encode them and reuse their slots; the blocks the write encodes are then read
    back decoded, instead of being encoded and decoded once more for the attention (as the torch path's
    attend-first order must)."""
    ctx = n - q.shape[0]
    w = lc.layout.window
    lo = exact_from(ctx, w)  # the first position the first query reads exactly (the sinks stay exact)
    e0 = min(lo, ctx)  # exact values from here on: the queries' own blocks (their windows)
    ke, ve = lc.exact(k), lc.exact(v)
    if ctx > lo and w:  # the ring: read before writing
        ko, vo = paged_torch.exact_rows(lc, pages, table, lo, ctx)
        ke, ve = torch.cat([ko.to(lc.dtype), ke]), torch.cat([vo.to(lc.dtype), ve])
    elif ctx > lo:  # the context's incomplete block waits in its page's tail slots: read before writing
        if exact is None:
            region = region_view(lc.layout, pages, lc.store_dtype)
            tail = region[table[lo // lc.block_size], :, TAIL_SLOT0:TAIL_SLOT0 + ctx - lo].to(lc.dtype)
        else:  # small pages: in slots 0.. of the request's ring page
            tail = exact[0][exact[2], :, : ctx - lo].to(lc.dtype)
        ke = torch.cat([tail[:, :, 0].transpose(0, 1), ke])
        ve = torch.cat([tail[:, :, 1].transpose(0, 1), ve])
    nq = k.shape[0]
    hi = n // BLOCK_TOKENS * BLOCK_TOKENS
    m = max(hi, min(n, SINK_TOKENS))  # sinks and whole blocks: all in the pages after the write (decoded up to
    x = _own_block(ctx, w)  # the last query's exact start: exact_from(m, w) >= it); exact keys from the first's
    flash = use_flash_prefill(q.dtype)
    # write, gather and attend in one C++ call (on the C++ kernel or flash), the same ops as the calls below; TaDA
    # over more than 16 KV heads writes in torch
    if not w and encodes(lc, pages, k.shape[1]):
        cos, sin = rope_tables(lc.rope, n)[:2]
        sink, ring = (-1, -1) if exact is None else exact[1:]
        store = lc.store_dtype
        kh, vh = (k, v) if k.dtype == store else (k.to(store), v.to(store))
        if not flash:
            _C.prefill_chunk(pages, q, kh, vh, ke, ve, positions, page_ids, _i32(table), m, x, e0, ctx, cos, sin,
                             float(lc.rope.scale) ** 2, *_args(lc, k.shape[1]), sink, ring, float(scale), out,
                             _bf16_scores(q.dtype, lc.dtype))
        else:  # write_gather + flash_prefill's parts (no window) in C++: the same ATen ops without their Python
            mask = short_mask(q.shape[0], ctx, q.shape[1] // k.shape[1], q.dtype)  # (cached across layers)
            _C.prefill_chunk_flash(pages, q, kh, vh, ke, ve, positions, page_ids, _i32(table), m, x, e0, ctx, cos,
                                   sin, float(lc.rope.scale) ** 2, *_args(lc, k.shape[1]), sink, ring, float(scale),
                                   out, _NO_MASK if mask is None else mask, _flash_gqa(), AMX_SHORT | AMX_LONG << 1)
        return
    if w:
        write_kv_window(lc, pages, k, v, torch.tensor([0, nq]), torch.tensor([n]), table[None])
    else:
        write_kv(lc, pages, k, v, positions, page_ids, exact=None if exact is None else
                 (exact[0], torch.full((nq,), exact[1], dtype=torch.long), torch.full((nq,), exact[2], dtype=torch.long)))
    kg, vg = gather_kv(lc, pages, table, m, exact=exact)
    kx, vx = (torch.cat([kg[x:e0], ke]), torch.cat([vg[x:e0], ve])) if e0 > x else (ke, ve)
    if flash and amx_prefill_ok(q, out):  # on AMX tiles (a recent window, or a format the fused call skips)
        _C.amx_prefill(q, kg, vg, kx, vx, x, ctx, float(scale), out, w)
    elif flash:
        flash_prefill(q, kg, vg, kx, vx, x, ctx, scale, out, window=w)
    else:
        prefill_attention(q, kg, vg, kx, vx, x, ctx, scale, out, window=w)


def _amx_takes(dtype: torch.dtype, D: int) -> bool:
    """Whether the AMX tile kernels (csrc/amx_attention.h) take a layer: bf16, head dims 32 .. 128 by 32, tiles
    granted or emulated (``_C.amx_ready``)."""
    return dtype == torch.bfloat16 and D % 32 == 0 and D <= 128 and _C.amx_ready()


def amx_prefill_ok(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether a chunk that would attend on flash in Python (``flash_prefill``: recent windows, formats the fused
    C++ call does not encode) attends on the AMX long-chunk kernel instead (``_C.amx_prefill``): ``AMX_LONG``
    (VLLM_TEMPORALKV_CPU_AMX_LONG), bf16, head dims 32 .. 128 by 32, AMX tiles granted (``_C.amx_ready``)."""
    return AMX_LONG and q.stride(-1) == 1 and out.stride(-1) == 1 and _amx_takes(q.dtype, q.shape[-1])


def use_flash_prefill(dtype: torch.dtype) -> bool:
    """Whether a served prefill chunk attends on torch's flash kernel (``cpu_flash.flash_prefill``: 2-3x faster
    than the C++ kernel on an AMX Xeon, bf16-rounded, not chunk-invariant) instead of the C++ kernel.  ``PREFILL``
    (VLLM_TEMPORALKV_CPU_PREFILL): flash / kernel as named; auto: a bf16 model on a CPU with AMX tiles (where the
    flash kernel's bf16 GEMMs run on them; without AMX the C++ kernel is as fast or faster), unless ``EXACT``."""
    if PREFILL != "auto":
        return PREFILL == "flash"
    return dtype == torch.bfloat16 and not EXACT and _cpu_class() == "amx"


def prefill_route(lc) -> str:
    """Where a served prefill chunk's attention runs, for the server log: '' on the C++ kernel (the path's own);
    where the flash path serves (``use_flash_prefill``), on AMX tiles (csrc/amx_attention.h; 'emulated' after
    ``set_amx_emulated``) where they take the layer - bf16, head dims 32 .. 128 by 32 - else torch's flash kernel."""
    if not use_flash_prefill(lc.dtype):
        return ""
    if (AMX_LONG or AMX_SHORT) and _amx_takes(lc.dtype, lc.layout.head_dim):
        tiles = "emulated AMX tiles" if _C.amx_emulated() else "AMX tiles"
        rest = "" if AMX_LONG and AMX_SHORT else f", {'short' if AMX_LONG else 'long'} chunks on torch's flash kernel"
        return f"prefill attention on {tiles}{rest}"
    return "prefill attention on torch's flash kernel"


_CLASS: tuple = (None, None)  # (cpu_class, its answer): asked by every served prefill chunk's layer


def _cpu_class() -> str:
    global _CLASS
    if _CLASS[0] is not cpu_class:  # (tests replace cpu_class)
        _CLASS = (cpu_class, cpu_class())
    return _CLASS[1]


# bf16 prefill scores and value sums where the CPU has AVX512_BF16 and the model is bf16
# (VLLM_TEMPORALKV_CPU_BF16_DOT=0: off)
BF16_DOT = os.environ.get("VLLM_TEMPORALKV_CPU_BF16_DOT", "1") != "0"


def _bf16_scores(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """prefill_attention's default ``bf16``: a bf16 chunk on a CPU whose kernels take bf16 scores (``BF16_DOT``)."""
    global _BF16_UNITS
    if _BF16_UNITS is None:
        _BF16_UNITS = bool(_C.bf16_dot())
    return BF16_DOT and q_dtype == kv_dtype == torch.bfloat16 and _BF16_UNITS


_BF16_UNITS: bool | None = None  # _C.bf16_dot(), asked once


@torch.no_grad()
def prefill_attention(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor,
                      x0: int, offset: int, scale: float, out: torch.Tensor | None = None,
                      bf16: bool | None = None, window: int = 0) -> torch.Tensor:
    """A prefill chunk's attention in C++: queries q [Tq, Hq, D] at positions offset.., each over the keys up to
    itself - decoded (kd / vd [>= its own block's start, H, D], positions 0..) before its own 8-token block, exact
    (kx / vx, positions x0..offset + Tq - 1, x0 <= the first query's own-block start) from there on.  The
    attention ``paged_torch._attend_fast`` computes (one softmax over both), float32, GQA without K/V copies, each
    query's output the same bit for bit however its prompt was chunked (csrc/prefill_impl.h).

    bf16 (default: ``BF16_DOT`` where q and the keys are bfloat16 and ``_C.bf16_dot()``): the scores as AVX512_BF16
    dot products of the bf16 values (exact products, float32 sums in another order: agrees with the float32 scores
    to float32 rounding; ~2x fewer instructions) and, where the values are bfloat16 too, the value sums likewise with
    the softmax weights rounded to bf16 (as bf16 flash kernels round them; an output moves by at most 2^-9 of the
    largest value it averages: below its own bf16 rounding), the rest as without.  window: a recent window - each
    query reads exactly from ``window`` tokens before its own block (``_own_block(p, window)``) instead."""
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if bf16 is None:
        bf16 = kd.dtype == kx.dtype == q.dtype and _bf16_scores(q.dtype, kd.dtype)
    # (the padding to whole tiles, the keys' tiling and the conversions happen in the C++ call: one pass)
    _C.prefill_attention(q, kd, vd, kx, vx, int(x0), int(offset), float(scale), out, bool(bf16), int(window))
    return out

_load()

__all__ = ["StepPlan", "available", "decode_attention", "encodes", "forward", "gather_kv", "isa", "nearest",
           "paged_attention", "plan_step", "prefill_attention", "set_isa", "use_flash_prefill",
           "supported_isas", "supports", "write_kv"]
