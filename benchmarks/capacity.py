"""KV capacity: how many tokens vLLM says fit in the same KV memory, per --kv-cache-dtype.

    python -m benchmarks.capacity                      # SmolLM2 on this machine's vLLM, 1 GiB of KV
    python -m benchmarks.capacity --formats auto temporalkv-2bit --block-sizes 1024

Each configuration starts the real server (`python -m vllm.entrypoints.openai.api_server`) and reads
the "KV cache size: N tokens" line vLLM logs once it has sized the cache; the server is stopped
right after (started with --enforce-eager: the sizing does not depend on it). The ratio to `auto` is what a user gets: N for the format / N for auto, same memory.
Also measured: where the half-precision sinks and tail live costs capacity per page, so the
page (block) size is swept for temporalkv-2bit, and so is the recent window (``--windows``: the serving option
``temporalkv_recent_window``, whose tokens every page keeps in half precision).  Rows of an earlier run with
the same settings are kept unless measured again (page sizes are arithmetic: they do not depend on the machine).
Writes capacity.json / capacity.md / capacity.png under benchmarks/results/ and merges
``capacity.<model>-<device>.<format>.ratio_vs_auto`` into headline.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from vllm_temporalkv.formats import FORMATS
from vllm_temporalkv.harness.server import CAPACITY_RE, VLLMServer

from .common import add_out_arg, merge_headline, run_record, write_json


def measure(model: str, dtype: str, kv_space_gib: int, max_len: int, extra: list[str], timeout: float = 900) -> dict:
    """Start a server, wait for the KV sizing line (or an exit), stop it."""
    s = VLLMServer(model, "--kv-cache-dtype", dtype, "--max-model-len", str(max_len), "--dtype", "bfloat16",
                   "--enforce-eager", *extra, kv_space_gib=kv_space_gib)  # no compile warm-up: sizing comes first
    t0 = time.time()
    s.launch()
    try:
        while time.time() - t0 < timeout:
            m = CAPACITY_RE.findall(s.log())
            if m:
                return {"tokens": int(m[-1].replace(",", "")), "seconds": round(time.time() - t0, 1)}
            if s.proc.poll() is not None:
                err = [ln for ln in s.log().splitlines() if "Error" in ln or "error" in ln]
                return {"error": (err[-1] if err else f"exit code {s.proc.returncode}")[-400:]}
            time.sleep(1)
        return {"error": f"no KV sizing line after {timeout} s"}
    finally:
        s.stop()


def configs(formats: list[str], block_sizes: list[int], outliers: bool,
            windows: list[int] = (), big: bool = False) -> list[tuple[str, str, list[str]]]:
    out = []
    for f in formats:
        out.append((f, f, []))
        if outliers and f in FORMATS and FORMATS[f].needs_calibration:
            out.append((f"{f}-o1", f, ["--additional-config", json.dumps({"temporalkv_outliers": True})]))
    for b in block_sizes:
        out.append((f"temporalkv-2bit@block{b}", "temporalkv-2bit", ["--block-size", str(b)]))
    for w in windows:
        out.append((f"temporalkv-2bit@window{w}", "temporalkv-2bit",
                    ["--additional-config", json.dumps({"temporalkv_recent_window": w})]))
    if big:
        out.append(("temporalkv-2bit@big", "temporalkv-2bit",
                    ["--additional-config", json.dumps({"temporalkv_small_pages": False})]))
    return out


def write_markdown(rep: dict, path: Path) -> None:
    s = rep["settings"]
    lines = [f"# KV capacity vLLM reports ({s['model']}, {s['kv_space_gib']} GiB of KV memory, max model len {s['max_model_len']})",
             "", *[f"Command: `{c}`  " for c in sorted({r.get("command", rep["run"]["command"]) for r in rep["configs"].values()})],
             f"Machine: {rep['run']['machine']['cpu']}, {rep['run']['time']}", "",
             "| --kv-cache-dtype | KV tokens | × auto | note |", "|---|---|---|---|"]
    for name, r in rep["configs"].items():
        if "error" in r:
            lines.append(f"| {name} | – | – | refused: {r['error'][:160].replace('|', '/')} |")
        else:
            lines.append(f"| {name} | {r['tokens']:,} | {r.get('ratio_vs_auto', float('nan')):.2f} | |")
    lines += ["", "`-o1`: 1% dense-and-sparse outliers enabled (`--additional-config '{\"temporalkv_outliers\": true}'`).",
              "A codebook format without `@`: its default pages on the CPU, small pages (`temporalkv_small_pages`, issue",
              "34) - 64-token pages of codes only (1-bit codes: 128, a page of them fills an exact page), each request's",
              "sinks and incomplete block in two pages of a second KV-cache group. vLLM then reports max-model-len x the",
              "requests that fit at that length, each paying its two exact pages: at 2 bits 8x / (1 + 2 x 64 /",
              "max-model-len). (Rows measured before 2026-11-29, see their command, had 1024-token pages, as `@big`.)",
              "`@big`: `temporalkv_small_pages` false - 1024-token pages that keep 16 half-precision token slots (8 sinks,",
              "8 tail) per KV head: at 2 bits 128 token-equivalents of codes plus 16 slots, 8x / (1 + 16/128) = 7.1x.",
              "`@blockN`: `--block-size N`, pages that carry their own sinks and tail like `@big`'s, so smaller ones spend",
              "a larger share on them. Larger pages gain a little more (2048: see the row) but a page is vLLM's unit of",
              "allocation, so every short request or partly filled last page wastes more; 1024 is the default where",
              "small pages are not served (the GPU, a recent window, the calibration-free and per-layer formats).",
              "`@windowN`: a recent window of N half-precision tokens (`temporalkv_recent_window`): every page keeps N",
              "more slots for it, so it costs N x 16 bits per page of 1024 tokens; the selective formats keep 128 by default."]
    path.write_text("\n".join(lines) + "\n")


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [(n, r["ratio_vs_auto"]) for n, r in rep["configs"].items() if "ratio_vs_auto" in r]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(items) + 1.5))
    ax.barh([n for n, _ in items][::-1], [v for _, v in items][::-1], color="tab:blue")
    for i, (_, v) in enumerate(items[::-1]):
        ax.text(v, i, f" {v:.2f}×", va="center", fontsize=8)
    ax.axvline(1.0, color="gray", lw=1)
    ax.set_xlabel("KV tokens vLLM reports ÷ those for --kv-cache-dtype auto (same memory)")
    ax.set_title(f"KV capacity, {rep['settings']['model']} ({rep['run']['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    from vllm_temporalkv.models import resolve_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct (its artifact "
                   "must be in <model>/temporalkv/calibration.safetensors: run `python -m calibrate` first)")
    p.add_argument("--name", default="smollm2-cpu", help="model-and-device tag in the headline keys")
    p.add_argument("--formats", nargs="+", default=["auto", "fp8"] + list(FORMATS))
    p.add_argument("--block-sizes", nargs="*", type=int, default=[64, 256, 2048])
    p.add_argument("--windows", nargs="*", type=int, default=[32, 128],
                   help="recent windows to measure for temporalkv-2bit (temporalkv_recent_window)")
    p.add_argument("--no-outliers", action="store_true", help="skip the -o1 configurations")
    p.add_argument("--big-pages", action="store_true",
                   help="also temporalkv-2bit@big (temporalkv_small_pages false: the 1024-token pages)")
    p.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    p.add_argument("--max-model-len", type=int, default=2048)
    add_out_arg(p)
    args = p.parse_args(argv)
    model = str(resolve_model(args.model))
    if "auto" not in args.formats:
        args.formats = ["auto"] + args.formats
    settings = {"model": args.name, "kv_space_gib": args.kv_space_gib, "max_model_len": args.max_model_len}
    out = Path(args.out)
    res = {}
    if (out / "capacity.json").is_file():
        prev = json.loads((out / "capacity.json").read_text())
        if prev.get("settings") == settings:
            res = {n: {"command": prev["run"]["command"], **r} for n, r in prev["configs"].items() if "error" not in r}
    todo = configs(args.formats, args.block_sizes, not args.no_outliers, args.windows, args.big_pages)
    for name, dtype, extra in tqdm(todo, desc="servers", unit="server"):
        res[name] = {**measure(model, dtype, args.kv_space_gib, args.max_model_len, extra),
                     "command": run_record()["command"]}
        tqdm.write(f"{name:34} {res[name]}")
        if name == "auto" and "tokens" not in res[name]:
            raise SystemExit(f"--kv-cache-dtype auto did not start: {res[name]}")
    base = res["auto"].get("tokens")
    if not base:
        raise SystemExit(f"--kv-cache-dtype auto did not start: {res['auto']}")
    for r in res.values():
        if "tokens" in r:
            r["ratio_vs_auto"] = r["tokens"] / base
    rep = {"settings": settings, "configs": res, "run": run_record()}
    write_json(out / "capacity.json", rep)
    write_markdown(rep, out / "capacity.md")
    plot(rep, out / "capacity.png")
    merge_headline({f"capacity.{args.name}.{n}.ratio_vs_auto": r["ratio_vs_auto"]
                    for n, r in res.items() if "ratio_vs_auto" in r and "@" not in n and n != "auto"})
    print((out / "capacity.md").read_text())


if __name__ == "__main__":
    main()
