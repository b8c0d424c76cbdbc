"""The CUDA decode kernel (csrc/cuda/) without a GPU.

* it compiles with nvcc for sm_90a and sm_80 with no local-memory spills, no stack, and a shared-memory plan within
  each card's limit (skipped, with the reason, where nvcc is absent);
* its integer maps (csrc/cuda/maps.cuh) and parameter blocks (params.cuh), compiled for the host, equal the
  emulator's maps and the loader's ctypes structures, value by value and field by field (skipped without g++);
* the emulator of its thread program (ops/cuda_emulator.py: lane maps, byte-addressed shared memory, mma /
  movmatrix fragments, fp16 key math, split and unit merges, the exact tokens) matches paged_torch.paged_attention
  on every format case of tests/test_triton_kernels.py within the Triton tests' tolerance;
* shared-memory bank conflicts as the design promises: the codebook gathers of vector codes of 4 and 8 floats and
  of every temporal V take one wavefront per half-warp (8-byte loads) / quarter-warp (16-byte), codes of 2 floats
  and scalar codebooks at most 2 wavefronts per 32-lane load; without the V skew V gathers conflict;
* the loader stays out of the CPU path, ``ops.select`` takes it where it can serve (``=0`` opts out) and says why not; the driver
  marshalling (ctypes) passes the parameter block as the kernel expects.
"""

import ctypes
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.kernel_cases import CASES, IDS, _batch, _decode_setup, _tol
from vllm_temporalkv.ops import cuda_emulator as emu, cuda_plan as P, paged_torch as reference

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "csrc" / "cuda"
NVCC = next((p for p in ("/usr/local/cuda-13.0/bin/nvcc", "/usr/local/cuda/bin/nvcc", shutil.which("nvcc") or "")
             if p and Path(p).is_file()), None)
GXX = shutil.which("g++")
ARCHS = {"sm_90a": ("arch=compute_90a,code=sm_90a", (9, 0)), "sm_80": ("arch=compute_80,code=sm_80", (8, 0))}

# the compile check covers every K and V code path and chunk / bits, both head dims, outliers on and off, both
# dtypes and the unskewed V: the headline (temporalkv-2bit), the largest stage (4 bits), 1 bit at D = 64,
# ChannelKV, a K/V pair with the hybrid's channel K of 2, KVQuant, and channel K of 8 with scalar V, no skew;
# sm_80 (A100's 164 KiB of shared memory) for the first three
COMPILE_VARIANTS = [
    P.Variant(0, 4, 0, 4, 128, False, True), P.Variant(0, 2, 0, 2, 128, True, True),
    P.Variant(0, 8, 0, 8, 64, True, False), P.Variant(1, 4, 1, 4, 128, True, True),
    P.Variant(1, 2, 0, 4, 64, False, False), P.Variant(2, 4, 2, 4, 128, True, False),
    P.Variant(1, 8, 2, 1, 64, False, True, vskew=False),
]
# each compiled for the CTA size serving would launch it with (registers capped at 64K / threads)
COMPILE_VARIANTS = [dataclasses.replace(v, threads=P.default_threads(v.km, v.vm)) for v in COMPILE_VARIANTS]
SM80_VARIANTS = 3


# ---- nvcc ------------------------------------------------------------------------------------------------------


def _nvcc(variant: P.Variant, gencode: str) -> str:
    from vllm_temporalkv.ops.cuda import NVCC_FLAGS

    cmd = [NVCC, "-cubin", f"-gencode={gencode}", *NVCC_FLAGS, *[f"-D{k}={v}" for k, v in variant.defines.items()],
           "-o", os.devnull, str(SRC / "decode.cu")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (/usr/local/cuda-13.0/bin/nvcc, /usr/local/cuda, PATH): "
                                         "the CUDA kernel's compile check needs the CUDA toolkit")
def test_nvcc_compiles_every_variant_without_spills():
    from vllm_temporalkv.ops.cuda import resource_usage

    jobs = [(v, "sm_90a") for v in COMPILE_VARIANTS] + [(v, "sm_80") for v in COMPILE_VARIANTS[:SM80_VARIANTS]]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        outs = list(ex.map(lambda va: _nvcc(va[0], ARCHS[va[1]][0]), jobs))
    report = {}
    for (v, arch), out in zip(jobs, outs):
        use = resource_usage(out)
        assert set(use) == {"tkv_decode", "tkv_merge"}, out
        for kernel, u in use.items():
            assert u["spill_stores"] == u["spill_loads"] == u["stack"] == 0, (v.name, arch, kernel, u)
            assert u["registers"] <= 255, (v.name, arch, kernel, u)
        assert "bytes smem" not in out or all(int(x) == 0 for x in __import__("re").findall(r"(\d+) bytes smem", out))
        limit = P.SMEM_LIMITS[ARCHS[arch][1]]
        plan = P.choose_units(v, limit)  # dynamic shared memory: the most units that fit the card
        assert plan.bytes <= limit and plan.units >= 1, (v.name, arch, plan)
        report[f"{v.name}@{arch}"] = dict(registers=use["tkv_decode"]["registers"], smem=plan.bytes, units=plan.units)
    print(json.dumps(report, indent=1))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the layout probe of the GPU check needs the CUDA toolkit")
def test_nvcc_compiles_the_layout_probe():
    r = subprocess.run([NVCC, "-cubin", f"-gencode={ARCHS['sm_90a'][0]}", "-O3", "-std=c++17", "-o", os.devnull,
                        str(SRC / "probe.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


# ---- the header on the host ------------------------------------------------------------------------------------------

HOST_PROGRAM = textwrap.dedent("""
    #include <cstddef>
    #include <cstdio>
    #include <initializer_list>
    #include "maps.cuh"
    #include "params.cuh"
    using namespace tkvc;
    int main() {
      printf("{\\"row_token\\": [");
      for (int mt = 0; mt < 2; ++mt) for (int r = 0; r < 16; ++r) printf("%s%d", mt + r ? "," : "", row_token(mt, r));
      printf("], \\"k_channel\\": [");
      int f = 1;
      for (int HD : {32, 64}) for (int u = 0; u < 2; ++u) for (int kc = 0; kc < 4; ++kc) for (int j = 0; j < 4; ++j)
        for (int o = 0; o < 4; ++o) { printf("%s%d", f ? "" : ",", k_channel(u, kc, j, o, HD)); f = 0; }
      printf("], \\"k_option\\": [");
      for (int s = 0; s < 4; ++s) for (int n = 0; n < 8; ++n) printf("%s%d", s + n ? "," : "", k_option(s, n));
      printf("], \\"unskew\\": [");
      for (int n = 0; n < 8; ++n) printf("%s%u,%u", n ? "," : "", unskew_selector(0, 1, n), unskew_selector(2, 3, n));
      printf("], \\"v_channel\\": [");
      f = 1;
      for (int vl : {2, 4, 8}) for (int uv = 0; uv < 2; ++uv) for (int cp = 0; cp < 2; ++cp) for (int o = 0; o < 4; ++o)
        for (int n = 0; n < 8; ++n) { printf("%s%d", f ? "" : ",", v_channel(uv, cp, o, n, vl)); f = 0; }
      printf("], \\"v_option\\": [");
      f = 1;
      for (int sk = 0; sk < 2; ++sk) for (int s = 0; s < 4; ++s) for (int j = 0; j < 4; ++j) {
        printf("%s%d", f ? "" : ",", v_option(s, j, sk)); f = 0; }
      printf("], \\"swz\\": [");
      f = 1;
      for (int G : {8, 16, 32, 64, 128}) for (int g = 0; g < G; ++g) { printf("%s%d", f ? "" : ",", swz(g, G)); f = 0; }
      printf("], \\"code_bytes\\": [");
      f = 1;
      for (int m = 0; m < 3; ++m) for (int l : {1, 2, 4, 8}) for (int D : {64, 128}) {
        printf("%s%d", f ? "" : ",", code_bytes(m, l, D)); f = 0; }
      printf("], \\"decode\\": {\\"size\\": %zu", sizeof(DecodeParams));
      %DECODE%
      printf("}, \\"merge\\": {\\"size\\": %zu", sizeof(MergeParams));
      %MERGE%
      printf("}}\\n");
    }
""")


@pytest.fixture(scope="module")
def host_maps(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ not found: the host build of csrc/cuda/maps.cuh and params.cuh needs a C++ compiler")
    from vllm_temporalkv.ops.cuda import DECODE_FIELDS, MERGE_FIELDS

    def offsets(struct, fields):
        return "\n".join(f'printf(", \\"{n}\\": %zu", offsetof({struct}, {n}));' for n, _ in fields)

    d = tmp_path_factory.mktemp("maps")
    src = HOST_PROGRAM.replace("%DECODE%", offsets("DecodeParams", DECODE_FIELDS)).replace(
        "%MERGE%", offsets("MergeParams", MERGE_FIELDS))
    (d / "maps.cpp").write_text(src)
    r = subprocess.run([GXX, "-std=c++17", "-O0", f"-I{SRC}", str(d / "maps.cpp"), "-o", str(d / "maps")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(subprocess.run([str(d / "maps")], capture_output=True, text=True, check=True).stdout)


def test_emulator_maps_are_the_kernels(host_maps):
    m = host_maps
    assert m["row_token"] == [emu.row_token(mt, r) for mt in range(2) for r in range(16)]
    assert m["k_channel"] == [emu.k_channel(u, kc, j, o, HD) for HD in (32, 64) for u in range(2) for kc in range(4)
                              for j in range(4) for o in range(4)]
    assert m["k_option"] == [emu.k_option(s, n) for s in range(4) for n in range(8)]
    assert m["unskew"] == [x for n in range(8) for x in (emu.unskew_selector(0, 1, n), emu.unskew_selector(2, 3, n))]
    assert m["v_channel"] == [emu.v_channel(uv, cp, o, n, vl) for vl in (2, 4, 8) for uv in range(2) for cp in range(2)
                              for o in range(4) for n in range(8)]
    assert m["v_option"] == [int(emu.v_option(s, j, sk)) for sk in range(2) for s in range(4) for j in range(4)]
    assert m["swz"] == [emu.swz(g, G) for G in (8, 16, 32, 64, 128) for g in range(G)]
    assert m["code_bytes"] == [D * l if mth == 2 else 8 * D // l for mth in range(3) for l in (1, 2, 4, 8)
                               for D in (64, 128)]


def test_parameter_blocks_match_the_header(host_maps):
    from vllm_temporalkv.ops.cuda import DecodeParams, MergeParams

    for name, cls in (("decode", DecodeParams), ("merge", MergeParams)):
        got = {n: getattr(cls, n).offset for n, _ in cls._fields_}
        want = dict(host_maps[name])
        assert want.pop("size") == ctypes.sizeof(cls), name
        assert got == want, name


def test_maps_cover_each_slice_once():
    """Each lane map is a bijection onto its slice: K options x chunks x lanes = 32 low channels + partners,
    V options x pairs x lanes = 64 channels, for every chunk length."""
    for HD in (32, 64):
        for u in range(HD // 32):
            ch = sorted(emu.k_channel(u, kc, j, o, HD) for kc in range(4) for j in range(4) for o in range(4))
            low = list(range(32 * u, 32 * u + 32))
            assert ch == sorted(low + [c + HD for c in low])
    for vl in (2, 4, 8):
        for uv in range(2):
            ch = sorted(emu.v_channel(uv, cp, o, n, vl) for cp in range(2) for o in range(4) for n in range(8))
            assert ch == list(range(64 * uv, 64 * uv + 64))
    assert sorted(emu.row_token(mt, r) for mt in range(2) for r in range(16)) == list(range(32))


# ---- the emulator against the oracle ---------------------------------------------------------------------------------

LENS = [1, 5, 8, 9, 16, 17, 40, 75]  # < 8, 8..16, several pages (as test_decode_matches_reference)


def _decode_case(case, seed=2, **kw):
    lc, pages, tables, kv, q = _decode_setup(case, LENS, seed=seed)
    ctx = {r: (0, n - 1) for r, n in enumerate(LENS) if n > 1}
    reference.write_kv(lc, pages, *_batch(kv, ctx, tables, lc.block_size))
    key = torch.stack([kv[r][0][-1] for r in range(len(LENS))]).to(lc.dtype)
    val = torch.stack([kv[r][1][-1] for r in range(len(LENS))]).to(lc.dtype)
    qsl = torch.arange(len(LENS) + 1)
    sl = torch.tensor(LENS)
    scale = case[1] ** -0.5
    ref = reference.paged_attention(lc, pages, q, key, val, qsl, sl, tables, scale)
    res = emu.paged_attention(lc, pages, q, key, val, qsl, sl, tables, scale, **kw)
    return lc, ref, res


@pytest.fixture(scope="module")
def emulated():
    """Every format case emulated once: 3 splits, 2 units per CTA (unit and split merges both exercised)."""
    return {cid: _decode_case(case, splits=3, units=2) for case, cid in zip(CASES, IDS)}


@pytest.mark.parametrize("cid", IDS)
def test_emulator_matches_reference(emulated, cid):
    lc, ref, res = emulated[cid]
    assert res.launch.S == 3 and res.launch.plan.units == 2
    err = (res.out.float() - ref.float()).abs().amax((1, 2))
    assert err.max() <= _tol(lc.dtype) * max(1.0, ref.float().abs().max().item()), err.tolist()


def test_emulator_default_launch_matches_reference():
    """The heuristic launch shape (one split here, 4 units at D = 128), no outliers and outliers."""
    for case in (CASES[1], CASES[5]):
        lc, ref, res = _decode_case(case, seed=5)
        err = (res.out.float() - ref.float()).abs().max()
        assert err <= _tol(lc.dtype) * max(1.0, ref.float().abs().max().item())


def _wf(res, site):
    st = res.stats[site]
    return st.wavefronts, st.ideal


@pytest.mark.parametrize("cid", IDS)
def test_bank_conflicts_as_designed(emulated, cid):
    lc, _, res = emulated[cid]
    v = res.launch.variant
    for kind, m, l in (("k", v.km, v.kl), ("v", v.vm, v.vl)):
        got, ideal = _wf(res, f"{kind}.gather")
        if m != P.KERNEL_SCALAR and (l in (4, 8) or (kind == "v" and m == P.KERNEL_TOKEN_VECTOR)) \
                or (kind == "v" and m == P.KERNEL_CHANNEL_VECTOR):
            assert got == ideal, (kind, got, ideal)  # one wavefront per half-warp (8 B) / per 32 lanes (<= 4 B)
        else:
            assert got <= 2 * ideal, (kind, got, ideal)  # 2-float codes, scalar codebooks: 16 lanes per wavefront
        codes, ideal = _wf(res, f"{kind}.codes")
        assert codes <= 4 * ideal, (kind, codes, ideal)


def test_v_skew_is_what_makes_v_gathers_conflict_free():
    _, ref, res = _decode_case(CASES[1], vskew=False)  # temporalkv-2bit, D = 128
    got, ideal = _wf(res, "v.gather")
    assert got > 3 * ideal  # the 4 lanes of a quad read 4 codes of one group (masked blocks' stale codes may match)
    assert (res.out.float() - ref.float()).abs().max() <= _tol(torch.float16) * max(1.0, ref.float().abs().max().item())


# ---- loader and wiring without a GPU --------------------------------------------------------------------------------


def test_the_cpu_path_does_not_import_the_cuda_loader():
    code = ("import sys, torch; from vllm_temporalkv import ops; from vllm_temporalkv.ops import paged_torch; "
            "assert 'vllm_temporalkv.ops.cuda' not in sys.modules and 'vllm_temporalkv.ops.cuda_path' not in "
            "sys.modules, sorted(m for m in sys.modules if 'cuda' in m); "
            "import vllm_temporalkv.ops.cuda_emulator, vllm_temporalkv.ops.cuda_plan; "
            "assert 'vllm' not in sys.modules and 'triton' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_select_takes_the_cuda_decode_where_it_can_serve(monkeypatch):
    from tests.kernel_cases import make_cache
    from vllm_temporalkv import ops
    from vllm_temporalkv.ops import cuda

    lc = make_cache("temporalkv-2bit", 64, True, torch.bfloat16, 1)
    dev = torch.device("cuda")  # select only reads the device type; nothing is allocated there
    monkeypatch.delenv(ops.ENV_CUDA_DECODE, raising=False)
    mod, name = ops.select(lc, dev)  # no GPU here: the loader says why, Triton keeps serving
    assert mod.__name__.endswith("triton_path") and "cannot serve" in name and "no CUDA device" in name
    monkeypatch.setattr(cuda, "prepare", lambda lc, device, num_query_heads=None: None)
    mod, name = ops.select(lc, dev)  # the kernel can serve: it does, by default
    assert mod.__name__.endswith("cuda_path") and name.startswith("CUDA decode")
    assert hasattr(mod, "plan_step") and hasattr(mod, "forward")  # what the backend calls
    monkeypatch.setenv(ops.ENV_CUDA_DECODE, "0")  # the way out: the Triton decode, and the log says why
    mod, name = ops.select(lc, dev)
    assert mod.__name__.endswith("triton_path") and f"{ops.ENV_CUDA_DECODE}=0" in name
    monkeypatch.delenv(ops.ENV_CUDA_DECODE)
    monkeypatch.setattr(cuda, "prepare", lambda lc, device, num_query_heads=None: "nvcc failed")
    assert "nvcc failed" in ops.select(lc, dev)[1]


def test_unsupported_says_why():
    from tests.kernel_cases import make_cache

    lc = make_cache("temporalkv-2bit", 64, True, torch.bfloat16, 1)
    assert P.unsupported(lc, num_query_heads=6) is None
    assert "8 query heads" in P.unsupported(lc, num_query_heads=2 * 9)
    assert "half-precision" in P.unsupported(lc.replace(dtype=torch.float32))
    odd = make_cache("temporalkv-2bit", 64, True, torch.bfloat16, 1, block_size=24)
    assert "power-of-two" in P.unsupported(odd)  # the kernel finds pages by shifts


def test_default_cta_size_per_code_path():
    lc = __import__("tests.kernel_cases", fromlist=["make_cache"]).make_cache("temporalkv-2bit", 128, False,
                                                                              torch.bfloat16, 1)
    assert P.variant_of(lc).threads == P.THREADS_TEMPORAL and P.variant_of(lc).name.endswith("-t384")
    assert P.make_launch(lc, 8, 32, 32768).plan.threads == P.THREADS_TEMPORAL
    assert P.make_launch(lc, 8, 32, 32768, threads=256).plan.threads == 256
    assert P.default_threads(1, 0) == P.default_threads(2, 2) == P.THREADS  # channel / scalar paths would spill


class _FakeCuda:
    """libcuda.so.1 stand-in: records the launches and reads the parameter block back through the pointer."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        fake = self

        class Fn:
            argtypes = restype = None

            def __call__(self, *args):
                if name == "cuLaunchKernel":
                    params = ctypes.cast(args[9][0], ctypes.POINTER(fake.struct)).contents
                    fake.launches.append((args[1:7], args[7], {f: getattr(params, f) for f, _ in params._fields_}))
                if name in ("cuModuleLoadData", "cuModuleGetFunction"):
                    args[0]._obj.value = 1234
                return 0

        fn = Fn()
        setattr(self, name, fn)
        return fn


def test_driver_passes_the_parameter_block():
    from tests.kernel_cases import make_cache
    from vllm_temporalkv.ops import cuda

    lc = make_cache("temporalkv-2bit", 128, True, torch.float16, 1)
    L = P.make_launch(lc, 8, 24, 2048)
    T = P.make_tables(lc, L.n_base, "cpu")
    ptrs = dict(pages=11, seq_lens=12, block_tables=13, q=14, part_acc=15, part_ml=16, bt_stride=128)
    params = cuda.decode_params(L, lc.layout, T, ptrs, 0.125)
    fake = _FakeCuda()
    fake.struct = cuda.DecodeParams
    drv = cuda.Driver(fake)
    drv.launch(ctypes.c_void_p(99), (L.S, L.H, 8), (L.plan.threads, 1, 1), L.plan.bytes, 7, params)
    (grid_block, smem, got), = fake.launches
    assert grid_block == (L.S, L.H, 8, L.plan.threads, 1, 1) and smem == L.plan.bytes
    assert got["pages"] == 11 and got["bt_stride"] == 128 and got["units"] == L.plan.units
    assert got["k_codes"] == lc.layout.k_codes and got["cap"] == lc.layout.cap == 10
    assert got["kcb"] == T.kcb.data_ptr() and abs(got["qk_scale"] - 0.125) < 1e-7
    assert got["off_merge"] == L.plan.off_merge and got["smem_bytes"] == L.plan.bytes
    mod = drv.load(b"\x7fELF")
    assert mod.value == 1234


def test_nvcc_command_and_resource_parsing():
    from vllm_temporalkv.ops import cuda

    v = P.Variant(0, 4, 0, 4, 128, True, True)
    cmd = cuda.nvcc_command("nvcc", v, (9, 0), Path("/tmp/x.cubin"), SRC)
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd and "-DTKV_OUTL=1" in cmd and cmd[-1].endswith("decode.cu")
    assert cuda.arch_flag((8, 6)) == "arch=compute_86,code=sm_86"
    out = ("ptxas info    : Compiling entry function 'tkv_decode' for 'sm_90a'\nptxas info    : Function properties "
           "for tkv_decode\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used "
           "169 registers, used 16 barriers\n")
    assert cuda.resource_usage(out) == {"tkv_decode": dict(stack=0, spill_stores=0, spill_loads=0, registers=169)}


@pytest.mark.parametrize("v", COMPILE_VARIANTS, ids=lambda v: v.name)
def test_shared_memory_plan_regions_do_not_overlap(v):
    """Tables, stages, exchanges, outlier buffers, query: disjoint and 16-byte aligned; the merge area aliases at
    most the stages and exchanges (read-free once the CTA's barrier passed), never the outlier buffers it reads."""
    for units in range(1, 256 // (32 * v.wpt) + 1):
        p = P.smem_plan(v, units)
        regions = [(0, v.table_bytes("k") + v.table_bytes("v")), (p.off_stage, units * 2 * p.stage_bytes)]
        if v.xchg:
            regions.append((p.off_xchg, units * 2 * v.wpt * 256 * 4))
        if v.outliers:
            regions += [(p.off_pbuf, p.threads // 32 * 1024), (p.off_corr, p.threads // 32 * 64 * 8 * 4),
                        (p.off_q, 8 * v.d * 4)]
        regions.sort()
        for (a, n), (b, _) in zip(regions, regions[1:]):
            assert a + n <= b and a % 16 == 0 and b % 16 == 0, (units, regions)
        merge = units * 8 * (v.d + 2) * 4
        end_safe = p.off_pbuf if v.outliers else max(a + n for a, n in regions)
        assert p.off_merge + merge <= end_safe or p.off_merge >= max(a + n for a, n in regions), (units, p)
        assert p.off_merge + merge <= p.bytes


def test_cuda_path_forward_with_the_emulator_as_the_kernel(monkeypatch):
    """ops.cuda_path.forward (what the backend calls when the CUDA decode serves) on mixed steps - prefill chunks,
    decodes after a chunk (gathered), decodes first (a slice), decode-only steps (one launch) - with the CPU
    emulator standing in for the CUDA launch: the torch path's outputs, its pages bit for bit, every decode row
    through the stand-in."""
    from tests.kernel_cases import GQ, H, _randn
    from vllm_temporalkv.ops import cuda, cuda_path

    calls = []

    def emulated(lc, pages, query, key, value, qsl, seq_lens, block_tables, scale, out=None, **kw):
        calls.append(query.shape[0])
        res = emu.paged_attention(lc, pages, query, key, value, qsl, seq_lens, block_tables, scale, **kw).out
        if out is None:
            return res
        out.copy_(res)
        return out

    monkeypatch.setattr(cuda, "paged_attention", emulated)
    case = ("temporalkv-2bit", 64, True, torch.bfloat16, 1)
    lens = [40, 23, 9]
    lc, pages, tables, kv, _ = _decode_setup(case, [n + 10 for n in lens], block_size=16, seed=5)
    ref = pages.clone()
    g = torch.Generator().manual_seed(6)
    steps = [{0: (0, 17), 1: (0, 22), 2: (0, 9)}, {1: (22, 23), 2: (9, 10), 0: (17, 40)},
             {0: (40, 41), 1: (23, 24), 2: (10, 11)}, {0: (41, 42), 2: (11, 12), 1: (24, 25)},
             {0: (42, 47), 1: (25, 26), 2: (12, 13)}]
    for step in steps:
        key, val, pos, pid = _batch(kv, step, tables, lc.block_size)
        q = _randn(g, key.shape[0], H * GQ, 64).to(lc.dtype)
        qsl = torch.tensor([0] + [b - a for a, b in step.values()]).cumsum(0)
        sl = torch.tensor([b for _, b in step.values()])
        bt = tables[list(step)]
        want = reference.forward(lc, ref, q, key, val, qsl, sl, bt, pos, pid, 0.125, batch_invariant=False)
        plan = cuda_path.plan_step(qsl, sl, pages.device)
        got = cuda_path.forward(lc, pages, q, key, val, qsl, sl, bt, pos, pid, 0.125, batch_invariant=False, plan=plan)
        assert (got.float() - want.float()).abs().max() <= _tol(lc.dtype) * max(1.0, want.float().abs().max().item())
        assert torch.equal(pages, ref), step
    assert calls == [2, 3, 3, 2]  # step 2's decodes first (a slice), 3 and 4 uniform, step 5's two after a chunk
