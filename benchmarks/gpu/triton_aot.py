"""Compile every Triton kernel of the serving path for a GPU architecture, here, without a GPU.

    python -m benchmarks.gpu.triton_aot                 # sm_90 (H100 / H200), the Triton installed here
    PYTHONPATH=/tmp/t36 python -m benchmarks.gpu.triton_aot --arch 90   # another Triton (the box's, e.g. 3.6.0)

Why: on the CPU the kernels run in Triton's interpreter, which never lowers them, so a kernel another Triton
version cannot compile is found only on the GPU box, after minutes of device time (2026-11-28: Triton 3.6's
front end refused a constexpr parameter's default ``""`` in ``_lookup``, called without it from
``_gather_kernel``; the interpreter and Triton 3.9 accept it).  This tool drives the launch sites of
tests/kernel_cases.py's format cases (``write_kv``, ``paged_attention`` with and without splits, ``gather_kv``, ``prefill_attention``)
with every ``JITFunction`` launch replaced by a compile to cubin for ``--arch`` (Triton's own ptxas, no
driver), and reports each kernel specialization it compiled or the error that stopped it.  Nothing runs, so
outputs are not checked here (tests/test_triton_kernels.py does, interpreted or on a GPU).
Exit status 1 when a kernel fails to compile.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time


def _compile_instead(arch: int, seen: dict):
    """A JITFunction.run that compiles the launch's specialization for sm_<arch> and launches nothing."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type

    option_names = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_pdl"}

    def run(self, *args, grid, warmup, **kwargs):
        opts = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        sig, const, runtime_const = {}, {}, []
        for p in self.params:
            v = bound.arguments[p.name]
            if p.is_constexpr:
                sig[p.name], const[p.name] = "constexpr", v
            elif v is None:
                sig[p.name], const[p.name] = "constexpr", None
            else:
                sig[p.name] = mangle_type(v)
                if sig[p.name] == "constexpr":  # a tl.constexpr value for a runtime parameter: Triton specializes on
                    const[p.name] = v           # it, one compile per value (on a GPU, a JIT stall per new length)
                    runtime_const.append(p.name)
        key = json.dumps([self.fn.__name__, sig, {k: repr(v) for k, v in const.items()}, repr(opts)])
        if key in seen:
            return None
        t = time.time()
        try:
            src = triton.compiler.ASTSource(self, sig, const)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
            seen[key] = dict(kernel=self.fn.__name__, ok=not runtime_const, seconds=round(time.time() - t, 2),
                             shared=getattr(k.metadata, "shared", None), constexprs=_short(const))
            if runtime_const:
                seen[key]["error"] = (f"runtime parameter(s) {runtime_const} passed as tl.constexpr: one compile per "
                                      "value (pass a Python int)")
        except Exception as e:  # noqa: BLE001 - the report names the kernel and the compiler's message
            seen[key] = dict(kernel=self.fn.__name__, ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}",
                             constexprs=_short(const))
        print(("ok   " if seen[key]["ok"] else "FAIL ") + self.fn.__name__ + " " + json.dumps(seen[key]["constexprs"]),
              flush=True)
        return None

    return run


def _short(const: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)) for k, v in const.items()}


def drive(cases) -> None:
    """The launch sites of the serving path on each case (CPU tensors; the launches only compile)."""
    import torch

    from tests.kernel_cases import _batch, _decode_setup
    from vllm_temporalkv.ops import paged_torch as reference, triton_decode, triton_encode, triton_prefill

    lens = [1, 5, 9, 17, 40, 75]
    for case in cases:
        lc, pages, tables, kv, q = _decode_setup(case, lens, block_size=16, seed=3)
        batch = _batch(kv, {r: (0, n - 1) for r, n in enumerate(lens) if n > 1}, tables, lc.block_size)
        triton_encode.write_kv(lc, pages.clone(), *batch)
        reference.write_kv(lc, pages, *batch)
        key = torch.stack([kv[r][0][-1] for r in range(len(lens))]).to(lc.dtype)
        val = torch.stack([kv[r][1][-1] for r in range(len(lens))]).to(lc.dtype)
        qsl, sl = torch.arange(len(lens) + 1), torch.tensor(lens)
        for splits in (None, 3):
            triton_decode.paged_attention(lc, pages, q, key, val, qsl, sl, tables, case[1] ** -0.5, splits=splits)
        triton_decode.gather_kv(lc, pages, tables[len(lens) - 1], lens[-1])
        # the prefill launch on chunks of the same requests (their last 1 .. 40 tokens)
        chunk = [min(n - 1, 40) for n in lens]
        qp = torch.cat([torch.randn(c, q.shape[1], q.shape[2]) for c in chunk]).to(lc.dtype)
        kp = torch.cat([kv[r][0][n - c:n] for r, (n, c) in enumerate(zip(lens, chunk))])
        vp = torch.cat([kv[r][1][n - c:n] for r, (n, c) in enumerate(zip(lens, chunk))])
        qsl = [0, *torch.tensor(chunk).cumsum(0).tolist()]
        triton_prefill.prefill_attention(lc, pages, qp, kp, vp, qsl, lens, tables, case[1] ** -0.5,
                                         torch.empty_like(qp), range(len(lens)), gather=triton_decode.gather_kv,
                                         write=lambda: None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    ap.add_argument("--cases", help="indices into tests/kernel_cases.py's CASES, comma-separated (default: all)")
    ap.add_argument("--out", help="write the report (JSON) here")
    a = ap.parse_args(argv)
    # before triton / the ops are imported: the interpreter (which tests.kernel_cases and CI ask for on a machine
    # without a GPU) compiles nothing
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.runtime.jit import JITFunction

    from tests.kernel_cases import CASES

    seen: dict = {}
    JITFunction.run = _compile_instead(a.arch, seen)
    t = time.time()
    drive([CASES[int(i)] for i in a.cases.split(",")] if a.cases else CASES)
    fails = [v for v in seen.values() if not v["ok"]]
    report = dict(triton=triton.__version__, arch=a.arch, cases=a.cases or "all", seconds=round(time.time() - t, 1),
                  compiled=len(seen) - len(fails), failed=fails, kernels=sorted({v["kernel"] for v in seen.values()}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(report, specializations=list(seen.values())), f, indent=1)
    for f in fails:
        print(f"\n{f['kernel']} {json.dumps(f['constexprs'])}:\n{f['error']}", file=sys.stderr)
    print(json.dumps({k: v for k, v in report.items() if k != "failed"}) + f"; {len(fails)} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
