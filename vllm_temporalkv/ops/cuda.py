"""The CUDA decode kernel of csrc/cuda/ (decode.cu), built on first use and launched through the CUDA driver.

* build: one cubin per kernel variant (``cuda_plan.Variant``: K / V code paths, head dim, outliers, dtype) and
  device architecture, compiled by ``nvcc -cubin`` and cached under ``VLLM_TEMPORALKV_CUDA_CACHE`` (default
  ~/.cache/vllm_temporalkv/cuda) by a hash of the sources, the defines, the architecture and the flags; a cached
  cubin is reused without nvcc (a machine can carry cubins built elsewhere for the same architecture).
* load / launch: ``libcuda.so.1`` through ctypes (cuModuleLoadData, cuLaunchKernel on torch's current stream:
  CUDA-graph capturable, no host sync), no Python package beyond torch.  The parameter blocks mirror
  csrc/cuda/params.cuh (checked field by field by tests/test_cuda_kernel.py against the header compiled on the
  host).
* ``paged_attention``: the twin of ``triton_decode.paged_attention`` (one query token per request).

Imported only on a CUDA device (ops/__init__.py; ``VLLM_TEMPORALKV_CUDA_DECODE=0`` keeps the Triton decode) or by the GPU
benchmark; ``available()`` says why not where it cannot serve, and the Triton kernels keep serving.  Checked on an
H100 against the torch oracle by benchmarks/gpu/h100.sh ``cuda``; on the CPU the emulator (ops/cuda_emulator.py)
replays its program.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import weakref
from pathlib import Path

import torch

from . import cuda_plan as P

ENV_CACHE = "VLLM_TEMPORALKV_CUDA_CACHE"
ENV_SRC = "VLLM_TEMPORALKV_CUDA_SRC"
ENV_NVCC = "VLLM_TEMPORALKV_NVCC"
SOURCES = ("decode.cu", "cfg.cuh", "k_frag.cuh", "maps.cuh", "merge.cuh", "outliers.cuh", "params.cuh", "ptx.cuh",
           "v_frag.cuh")
NVCC_FLAGS = ("-O3", "-std=c++17", "--resource-usage", "-lineinfo")
_LOCK = threading.Lock()


# ---- sources, compiler, cache ------------------------------------------------------------------------------------

def source_dir() -> Path | None:
    """csrc/cuda of a checkout (or ``VLLM_TEMPORALKV_CUDA_SRC``); None when absent (a wheel ships no sources yet)."""
    env = os.environ.get(ENV_SRC)
    cands = [Path(env)] if env else []
    cands.append(Path(__file__).resolve().parents[2] / "csrc" / "cuda")
    for c in cands:
        if (c / "decode.cu").is_file():
            return c
    return None


def find_nvcc() -> str | None:
    env = os.environ.get(ENV_NVCC)
    if env:
        return env if Path(env).is_file() else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "vllm_temporalkv" / "cuda")


def arch_flag(capability: tuple[int, int]) -> str:
    """nvcc's -gencode for a device: sm_90a on Hopper (its own instructions allowed), else sm_XY."""
    major, minor = capability
    a = f"{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"
    return f"arch=compute_{a},code=sm_{a}"


def nvcc_command(nvcc: str, variant: P.Variant, capability: tuple[int, int], out: Path, src: Path) -> list[str]:
    return [nvcc, "-cubin", f"-gencode={arch_flag(capability)}", *NVCC_FLAGS,
            *[f"-D{k}={v}" for k, v in variant.defines.items()], "-o", str(out), str(src / "decode.cu")]


_RES = re.compile(r"Compiling entry function '(\w+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
                  r"(\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def resource_usage(ptxas_output: str) -> dict[str, dict[str, int]]:
    """nvcc --resource-usage -> {kernel: {registers, stack, spill_stores, spill_loads}}."""
    return {m[0]: dict(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]), registers=int(m[4]))
            for m in _RES.findall(ptxas_output)}


def cache_key(variant: P.Variant, capability, src: Path) -> str:
    """Hash of what a cubin is built from: the sources, the defines, the architecture, the flags (not nvcc's
    version: clear the cache after a toolkit change)."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    h.update(json.dumps([variant.defines, list(capability), NVCC_FLAGS]).encode())
    return h.hexdigest()[:20]


def build(variant: P.Variant, capability: tuple[int, int]) -> tuple[Path, dict]:
    """The cubin of one variant for one architecture: cached (also one built elsewhere and copied into the cache),
    else compiled by nvcc.  Returns (path, nvcc's resource usage)."""
    src = source_dir()
    if src is None:
        raise RuntimeError("csrc/cuda sources not found (set VLLM_TEMPORALKV_CUDA_SRC to a checkout's csrc/cuda)")
    d = cache_dir()
    cubin = d / f"{variant.name}-sm{capability[0]}{capability[1]}-{cache_key(variant, capability, src)}.cubin"
    meta = cubin.with_suffix(".json")
    if cubin.is_file():
        return cubin, json.loads(meta.read_text()) if meta.is_file() else {}
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError(f"nvcc not found (CUDA_HOME, /usr/local/cuda, PATH or {ENV_NVCC}) and no cached {cubin}")
    d.mkdir(parents=True, exist_ok=True)
    tmp = cubin.with_suffix(f".{os.getpid()}.tmp")
    r = subprocess.run(nvcc_command(nvcc, variant, capability, tmp, src), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed for {cubin.name}:\n{r.stderr[-4000:]}")
    usage = resource_usage(r.stdout + r.stderr)
    meta.write_text(json.dumps(usage))
    os.replace(tmp, cubin)
    return cubin, usage


# ---- the driver, through ctypes ------------------------------------------------------------------------------------

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3


class Driver:
    """The few driver calls the launcher needs; every call's result checked."""

    def __init__(self, lib=None):
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        c = ctypes
        sig = {
            "cuModuleLoadData": [c.POINTER(c.c_void_p), c.c_void_p],
            "cuModuleGetFunction": [c.POINTER(c.c_void_p), c.c_void_p, c.c_char_p],
            "cuFuncSetAttribute": [c.c_void_p, c.c_int, c.c_int],
            "cuFuncGetAttribute": [c.POINTER(c.c_int), c.c_int, c.c_void_p],
            "cuLaunchKernel": [c.c_void_p, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint,
                               c.c_void_p, c.POINTER(c.c_void_p), c.POINTER(c.c_void_p)],
            "cuGetErrorName": [c.c_int, c.POINTER(c.c_char_p)],
            "cuCtxGetCurrent": [c.POINTER(c.c_void_p)],
        }
        for name, args in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, c.c_int

    def check(self, rc: int, what: str) -> None:
        if rc:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(s))
            raise RuntimeError(f"{what}: CUDA driver error {rc} ({(s.value or b'?').decode()})")

    def load(self, image: bytes):
        mod = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(image, len(image))
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), buf), "cuModuleLoadData")
        return mod

    def function(self, mod, name: str):
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"cuModuleGetFunction({name})")
        return fn

    def attribute(self, fn, attr: int) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, fn), "cuFuncGetAttribute")
        return v.value

    def set_smem(self, fn, nbytes: int) -> None:
        self.check(self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                   "cuFuncSetAttribute(max dynamic shared memory)")

    def launch(self, fn, grid, block, smem: int, stream: int, *params) -> None:
        """cuLaunchKernel with ``params`` (ctypes values: the kernels' one parameter block, or the probe's
        pointers) passed as the kernel's arguments, in order."""
        args = (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in params])
        self.check(self.lib.cuLaunchKernel(fn, *grid, *block, smem, ctypes.c_void_p(stream), args, None),
                   "cuLaunchKernel")


# ---- parameter blocks (csrc/cuda/params.cuh) -------------------------------------------------------------------------

_P, _I64, _I32, _F32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float

DECODE_FIELDS = [(n, _P) for n in ("pages", "seq_lens", "block_tables", "q", "kcb", "vcb", "kmean", "kstd", "vmean",
                                   "vinv", "dt_cos", "dt_sin", "base_cs", "base_cos", "base_sin", "part_acc",
                                   "part_ml")] + \
    [(n, _I64) for n in ("rec_bytes", "bt_stride", "k_codes", "v_codes", "k_idx", "k_val", "v_idx", "v_val")] + \
    [(n, _I32) for n in ("H", "GQ", "block_size", "S", "tiles_per_split", "cap", "n_base", "units")] + \
    [("qk_scale", _F32)] + \
    [(n, _I32) for n in ("off_stage", "stage_bytes", "off_xchg", "off_pbuf", "off_corr", "off_q", "off_merge",
                         "smem_bytes")]
MERGE_FIELDS = [(n, _P) for n in ("pages", "seq_lens", "block_tables", "q", "knew", "vnew", "vmean", "vstd",
                                  "part_acc", "part_ml", "out")] + \
    [(n, _I64) for n in ("rec_bytes", "bt_stride")] + [(n, _I32) for n in ("H", "GQ", "block_size", "S")] + \
    [("qk_scale", _F32), ("pad", _I32)]


class DecodeParams(ctypes.Structure):
    _fields_ = DECODE_FIELDS


class MergeParams(ctypes.Structure):
    _fields_ = MERGE_FIELDS


def decode_params(launch: P.Launch, lay, T: P.Tables, ptrs: dict[str, int], qk_scale: float) -> DecodeParams:
    """The decode kernel's parameter block; ``ptrs``: device pointers of pages, seq_lens, block_tables, q, part_acc,
    part_ml and the block table's row stride ("bt_stride")."""
    plan = launch.plan
    return DecodeParams(
        pages=ptrs["pages"], seq_lens=ptrs["seq_lens"], block_tables=ptrs["block_tables"], q=ptrs["q"],
        kcb=T.kcb.data_ptr(), vcb=T.vcb.data_ptr(), kmean=T.kmean.data_ptr(), kstd=T.kstd.data_ptr(),
        vmean=T.vmean.data_ptr(), vinv=T.vinv.data_ptr(), dt_cos=T.dt_cos.data_ptr(), dt_sin=T.dt_sin.data_ptr(),
        base_cs=T.base_cs.data_ptr(), base_cos=T.base_cos.data_ptr(), base_sin=T.base_sin.data_ptr(),
        part_acc=ptrs["part_acc"], part_ml=ptrs["part_ml"], bt_stride=ptrs["bt_stride"],
        **P.page_offsets(lay), H=launch.H, GQ=launch.GQ, block_size=lay.block_size, S=launch.S,
        tiles_per_split=launch.tiles_per_split, cap=launch.cap, n_base=launch.n_base, units=plan.units,
        qk_scale=qk_scale, off_stage=plan.off_stage, stage_bytes=plan.stage_bytes, off_xchg=plan.off_xchg,
        off_pbuf=plan.off_pbuf, off_corr=plan.off_corr, off_q=plan.off_q, off_merge=plan.off_merge,
        smem_bytes=plan.bytes)


def merge_params(launch: P.Launch, lay, T: P.Tables, ptrs: dict[str, int], qk_scale: float) -> MergeParams:
    return MergeParams(
        pages=ptrs["pages"], seq_lens=ptrs["seq_lens"], block_tables=ptrs["block_tables"], q=ptrs["q"],
        knew=ptrs["knew"], vnew=ptrs["vnew"], vmean=T.vmean.data_ptr(), vstd=T.vstd.data_ptr(),
        part_acc=ptrs["part_acc"], part_ml=ptrs["part_ml"], out=ptrs["out"], rec_bytes=lay.bytes,
        bt_stride=ptrs["bt_stride"], H=launch.H, GQ=launch.GQ, block_size=lay.block_size, S=launch.S,
        qk_scale=qk_scale, pad=0)


# ---- modules, tables, launch --------------------------------------------------------------------------------------------

_DRIVER: Driver | None = None
_MODULES: dict = {}  # (variant, device index) -> (decode function, merge function, usage)
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer cache -> {(device, n_base): Tables}
_STATUS: str | None = None


def driver() -> Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = Driver()
    return _DRIVER


def available() -> str | None:
    """None when the CUDA kernel can be built or loaded here, else why not (no GPU, no sources, no nvcc/cubins)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if source_dir() is None:
        return "csrc/cuda sources not found (a checkout's csrc/cuda, or VLLM_TEMPORALKV_CUDA_SRC)"
    if find_nvcc() is None and not any(cache_dir().glob("*.cubin")):
        return f"nvcc not found and no cached cubins in {cache_dir()}"
    try:
        driver()
    except OSError as e:
        return f"libcuda.so.1 not loadable: {e}"
    return None


def _device_limits(device: torch.device) -> tuple[tuple[int, int], int, int]:
    props = torch.cuda.get_device_properties(device)
    cap = (props.major, props.minor)
    smem = getattr(props, "shared_memory_per_block_optin", None) or P.SMEM_LIMITS.get(cap, 101376)
    return cap, props.multi_processor_count, int(smem)


def module(variant: P.Variant, device: torch.device):
    """(decode, merge, resource usage) of a variant on a device: built or loaded once."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (variant, idx)
    with _LOCK:
        if key not in _MODULES:
            cap, _, _ = _device_limits(device)
            cubin, usage = build(variant, cap)
            with torch.cuda.device(idx):
                torch.empty(1, device=device)  # the runtime makes the primary context current
                drv = driver()
                mod = drv.load(cubin.read_bytes())
                dec, mer = drv.function(mod, "tkv_decode"), drv.function(mod, "tkv_merge")
                usage = dict(usage, loaded=dict(registers=drv.attribute(dec, CU_FUNC_ATTRIBUTE_NUM_REGS),
                                                local_bytes=drv.attribute(dec, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)))
            _MODULES[key] = (mod, dec, mer, usage, {"smem": 0})
        return _MODULES[key]


def tables(lc, device: torch.device, n_base: int) -> P.Tables:
    per = _TABLES.setdefault(lc, {})
    key = (str(device), n_base)
    if key not in per:
        per.clear()  # a larger block table: rebuild (the RoPE base rows grow)
        per[key] = P.make_tables(lc, n_base, device)
    return per[key]


def prepare(lc, device: torch.device, num_query_heads: int | None = None) -> str | None:
    """Build / load this layer's variant now (None) or say why the CUDA kernel cannot serve it."""
    why = available() or P.unsupported(lc, num_query_heads)
    if why:
        return why
    try:
        module(P.variant_of(lc), device)
    except Exception as e:  # noqa: BLE001 - any failure leaves the Triton kernel serving, with the reason
        return f"{type(e).__name__}: {e}"
    return None


def build_source(name: str, capability: tuple[int, int]) -> Path:
    """A standalone .cu of csrc/cuda (the layout probe) -> cubin in the cache (no defines)."""
    src, nvcc = source_dir(), find_nvcc()
    if src is None or nvcc is None:
        raise RuntimeError("needs csrc/cuda and nvcc")
    h = hashlib.sha256((src / name).read_bytes() + (src / "ptx.cuh").read_bytes() + str(capability).encode())
    out = cache_dir() / f"{Path(name).stem}-sm{capability[0]}{capability[1]}-{h.hexdigest()[:16]}.cubin"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([nvcc, "-cubin", f"-gencode={arch_flag(capability)}", "-O3", "-std=c++17", "-o", str(out),
                            str(src / name)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed for {name}:\n{r.stderr[-3000:]}")
    return out


def describe(lc, device: torch.device) -> str:
    _, _, _, usage, _ = module(P.variant_of(lc), device)
    d = usage.get("tkv_decode", {})
    return f"{P.variant_of(lc).name}, {d.get('registers', '?')} registers, {d.get('spill_stores', '?')} B spills"


@torch.no_grad()
def paged_attention(lc, pages: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None, *, splits: int | None = None,
                    units: int | None = None, max_position: int | None = None, threads: int | None = None) -> torch.Tensor:
    """CUDA twin of ``triton_decode.paged_attention``: request r's one query token is query[r]
    (``query_start_loc`` is not read).  Reads only device tensors and makes no host sync.  ``splits`` / ``units``
    override the launch heuristic (tests), ``threads`` the CTA size compiled in (benchmarks)."""
    R, HQ, D = query.shape
    H = key.shape[1]
    if R != seq_lens.shape[0]:
        raise ValueError("cuda.paged_attention takes one query token per request")
    if out is None:
        out = torch.empty_like(query)
    if R == 0:
        return out
    device = pages.device
    lay = lc.layout
    cap, sms, smem_limit = _device_limits(device)
    cap_tokens = block_tables.shape[1] * lay.block_size
    L = P.make_launch(lc, R, HQ, cap_tokens, sms=sms, smem_limit=smem_limit, splits=splits, units=units,
                      threads=threads)
    _, dec, mer, _, state = module(L.variant, device)
    if state["smem"] < L.plan.bytes:
        driver().set_smem(dec, L.plan.bytes)
        state["smem"] = L.plan.bytes
    T = tables(lc, device, L.n_base)
    q = query.to(lc.dtype).contiguous()
    kn = key.to(lc.dtype).contiguous()
    vn = value.to(lc.dtype).contiguous()
    sl = seq_lens.to(device=device, dtype=torch.int32).contiguous()
    bt = block_tables.to(device=device, dtype=torch.int32)
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    part_acc = torch.empty(R, H, L.S, P.GQP, D, dtype=torch.float32, device=device)
    part_ml = torch.empty(R, H, L.S, P.GQP, 2, dtype=torch.float32, device=device)
    res = out if out.dtype == lc.dtype and out.is_contiguous() else torch.empty(R, HQ, D, dtype=lc.dtype,
                                                                                   device=device)
    ptrs = dict(pages=pages.data_ptr(), seq_lens=sl.data_ptr(), block_tables=bt.data_ptr(), q=q.data_ptr(),
                knew=kn.data_ptr(), vnew=vn.data_ptr(), part_acc=part_acc.data_ptr(), part_ml=part_ml.data_ptr(),
                out=res.data_ptr(), bt_stride=bt.stride(0))
    qs = P.qk_scale(scale)
    stream = torch.cuda.current_stream(device).cuda_stream
    drv = driver()
    drv.launch(dec, (L.S, L.H, R), (L.plan.threads, 1, 1), L.plan.bytes, stream, decode_params(L, lay, T, ptrs, qs))
    drv.launch(mer, (R, L.H, 1), (128, 1, 1), 0, stream, merge_params(L, lay, T, ptrs, qs))
    if res is not out:
        out.copy_(res)
    return out
