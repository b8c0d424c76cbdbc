"""Calibration: real text -> pre-RoPE K/V + Fisher weights -> k-means codebooks -> one artifact.

    temporalkv-calibrate [--model M] [--data wiki-leads] [--formats all] [--output FILE]

Work is checkpointed in ``<output>.work/`` (the collected activations, then one file per finished
layer), so an interrupted run restarts where it stopped; the directory is removed at the end.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .. import __version__
from ..artifact import Artifact, default_artifact_path, model_fingerprint
from ..codecs.quantizer import ChannelStats
from ..codecs.rotation import ROTATIONS, rotate
from ..formats import FormatError, calibrated_formats, check_head_dim, get_format

from .collect import CollectedStore
from .fit import fit_layer

THESIS_SAMPLES = 64  # 64 x 2048 tokens (thesis sec. 5.2)
CPU_SAMPLES = 8  # what fits the one-hour budget on two CPU cores (k-means dominates)
COLLECT_CHUNK = 4  # windows per collected file: what the collection holds in memory at once
COLLECT_LAYOUT = "chunked"  # in the run key: a work folder from the one-file collection starts over
ATTENTION = ("eager", "sdpa")  # how the calibration model attends while collecting (the first is the default)


def codebook_keys(formats: list[str]) -> list[str]:
    """Codebook families needed: TemporalKV also needs its channel twin for the hybrid."""
    keys: list[str] = []
    for name in formats:
        fmt = get_format(name)
        for key in [fmt.codebook_key] + ([fmt.channel_twin_key] if fmt.hybrid else []):
            if key not in keys:
                keys.append(key)
    return keys


def hybrid_choice(mse: dict[tuple[int, str, str], tuple[float, float]], fmt_name: str, num_layers: int):
    """Per layer, K and V separately: channel chunking where its Fisher-weighted MSE is lower.  -> (methods,
    [L, 2, 2] MSE table, [L, 2, 2] cost table (K/V x temporal/channel: fit.fisher_error), or Nones)."""
    fmt = get_format(fmt_name)
    if not fmt.hybrid:
        return {kv: [fmt.method] * num_layers for kv in "kv"}, None, None
    table, costs = torch.zeros(num_layers, 2, 2), torch.zeros(num_layers, 2, 2)
    methods = {"k": [], "v": []}
    for layer in range(num_layers):
        for j, kv in enumerate("kv"):
            (t, tc), (c, cc) = mse[(layer, kv, fmt.codebook_key)], mse[(layer, kv, fmt.channel_twin_key)]
            table[layer, j] = torch.tensor([t, c])
            costs[layer, j] = torch.tensor([tc, cc])
            methods[kv].append("channel" if c < t else "temporal")
    return methods, table, (costs if torch.isfinite(costs).all() else None)


def _run_key(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


FIT_ONLY = ("keys", "rotation")  # settings the per-layer fits depend on and the collection does not


def _reuse_work(work: Path, settings: dict, log) -> None:
    """Keep what a stopped run in ``work`` has that this one can use: the collection depends on the model, text,
    windows and attention, not on the codebook families (``keys``) or a rotation; the per-layer fits depend on
    all of it."""
    if not (work / "run.json").is_file():
        return
    old = json.loads((work / "run.json").read_text()).get("settings") or {}
    if old == settings:
        return
    if {k: v for k, v in old.items() if k not in FIT_ONLY} != {k: v for k, v in settings.items() if k not in FIT_ONLY}:
        log(f"discarding {work}: it holds a run with different settings")
        shutil.rmtree(work)
        return
    fitted = sorted(work.glob("layer_*.safetensors"))
    log(f"reusing the collection in {work}; discarding its {len(fitted)} fitted layers (other codebook families or "
        "rotation)")
    for p in fitted:
        p.unlink()


def run_calibration(
    *,
    model: str | None = None,
    data: str = "wiki-leads",
    formats: list[str] | None = None,
    num_samples: int | None = None,
    seq_len: int = 2048,
    iters: int = 50,
    seed: int = 0,
    fisher: bool = True,
    device: str = "auto",
    attention: str = "eager",
    low_memory: bool = False,
    rotation: dict[str, str] | None = None,
    output: str | Path | None = None,
    progress: bool = True,
    log=print,
) -> Artifact:
    from ..corpora import load_corpus, token_windows
    from ..models import load_hf_model, load_tokenizer, resolve_model

    t0 = time.time()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if num_samples is None:
        num_samples = THESIS_SAMPLES if device.startswith("cuda") else CPU_SAMPLES
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r} is not one of {', '.join(ATTENTION)} (--attention)")
    rotation = {kv: r for kv, r in (rotation or {}).items() if r}
    bad = [f"{kv}: {r!r}" for kv, r in rotation.items() if kv not in "kv" or r not in ROTATIONS]
    if bad:
        raise ValueError(f"rotation {', '.join(bad)}: give k and / or v, each one of {', '.join(ROTATIONS)} (--rotate)")
    formats = calibrated_formats() if not formats or formats == ["all"] else formats
    for f in formats:
        if not get_format(f).needs_calibration:  # fail early on a bad name, or one that has nothing to fit
            raise FormatError(f"{f} needs no calibration (it serves without an artifact); calibrate codebook "
                              f"formats: {' '.join(calibrated_formats())}")
    # a mixed format is served from its parts' codebooks (and their per-layer loss estimates)
    formats = list(dict.fromkeys(p for f in formats for p in get_format(f).calibrated_formats))
    keys = codebook_keys(formats)

    model_dir = resolve_model(model)
    output = Path(output) if output else default_artifact_path(model_dir)
    log(f"model {model_dir}\ndata {data}: {num_samples} x {seq_len} tokens\ndevice {device}")
    tok = load_tokenizer(model_dir)
    hf = load_hf_model(model_dir, dtype=torch.float32, device=device, attn_implementation=attention)
    fp = model_fingerprint(hf.config)
    for f in formats:
        check_head_dim(get_format(f), fp["head_dim"])
    L = fp["num_layers"]

    # eager keeps the layout name the default artifacts were made under; "sdpa" collects the same K / V and
    # gradients to ~1e-5 (3.5x faster on the CPU) but is another run
    layout = COLLECT_LAYOUT + ("" if attention == "eager" else f"-{attention}")
    # low memory: layers checkpointed, logits in chunks - the same K / V, gradients equal to float rounding, so
    # another run (its collection is not mixed with a stopped full-memory one)
    layout += "-lowmem" if low_memory else ""
    settings = dict(
        fingerprint=fp, data=data, num_samples=num_samples, seq_len=seq_len, iters=iters,
        seed=seed, fisher=fisher, keys=keys, collected=layout,
        **({"rotation": rotation} if rotation else {}),  # absent when off: older work folders match
    )
    work = output.with_name(output.name + ".work")
    run_key = _run_key(settings)
    _reuse_work(work, settings, log)
    work.mkdir(parents=True, exist_ok=True)
    (work / "run.json").write_text(json.dumps({"key": run_key, "settings": settings}))

    # ---- 1. activations and Fisher weights, streamed to disk a few windows at a time (resumable)
    store = CollectedStore(work, num_samples, chunk=COLLECT_CHUNK)
    t_collect = time.time()
    if store.missing():
        if len(store.missing()) < len(store.starts):
            log(f"resuming: {len(store.starts) - len(store.missing())} of {len(store.starts)} collected files in {work}")
        docs = load_corpus(data)
        windows = token_windows(tok, docs, seq_len, num_samples)
        store.collect(hf, windows, device=device, progress=progress, low_memory=low_memory)
    else:
        log(f"resuming: reusing collected activations in {work}")
    del hf
    t_collect = time.time() - t_collect

    # ---- 2. per layer: statistics, codebooks, MSE (one checkpoint file per layer)
    t_fit = time.time()
    stats, books, mse = {}, {}, {}
    bar = tqdm(total=L * 2 * len(keys), desc="k-means", unit="codebook set", disable=not progress)
    for layer in range(L):
        ckpt = work / f"layer_{layer:03d}.safetensors"
        if ckpt.is_file():
            t = load_file(str(ckpt))
            bar.update(2 * len(keys))
        else:
            acts, grads = store.layer(layer)
            # a rotation (codecs/rotation.py): activations and gradients alike, d loss / d (x R) = (d loss / d x) R
            dev_acts = {kv: rotate(acts[kv], rotation.get(kv)).to(device) for kv in "kv"}
            dev_grads = {kv: rotate(grads[kv], rotation.get(kv)).to(device) for kv in "kv"}
            del acts, grads
            st, bk, ms = fit_layer(layer, dev_acts, dev_grads, keys, iters=iters, seed=seed,
                                   fisher=fisher, on_fit=lambda: bar.update(1))
            t = {}
            for kv, s in st.items():
                for name in ("mean", "std", "lo", "hi"):
                    t[f"stats.{kv}.{name}"] = getattr(s, name).float().cpu().contiguous()
            for (kv, key), c in bk.items():
                t[f"codebook.{kv}.{key}"] = c.cpu().contiguous()
            for (kv, key), v in ms.items():
                t[f"mse.{kv}.{key}"] = torch.tensor(v)  # (mse, cost): fit.fisher_error
            save_file(t, str(ckpt.with_suffix(".tmp")))
            ckpt.with_suffix(".tmp").rename(ckpt)
        for kv in "kv":
            stats[(layer, kv)] = ChannelStats(*(t[f"stats.{kv}.{n}"] for n in ("mean", "std", "lo", "hi")))
            for key in keys:
                books[(layer, kv, key)] = t[f"codebook.{kv}.{key}"]
                m = t[f"mse.{kv}.{key}"].tolist()
                mse[(layer, kv, key)] = (m[0], m[1] if len(m) > 1 else float("nan"))  # a checkpoint without the cost
    bar.close()
    t_fit = time.time() - t_fit

    # ---- 3. hybrid choice and the artifact
    layer_methods, mse_tables, cost_tables = {}, {}, {}
    for name in formats:
        layer_methods[name], table, costs = hybrid_choice(mse, name, L)
        if table is not None:
            mse_tables[name] = table
        if costs is not None:
            cost_tables[name] = costs
    elapsed = time.time() - t0
    calibration = dict(
        data=data, num_samples=num_samples, seq_len=seq_len, tokens=num_samples * seq_len,
        sink_tokens_excluded=True, iters=iters, seed=seed, fisher=fisher, attention=attention,
        **({"low_memory": True} if low_memory else {}), codebooks=keys,
        **({"rotation": rotation} if rotation else {}),
        device=device if not device.startswith("cuda") else torch.cuda.get_device_name(),
        machine=f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        seconds=dict(total=round(elapsed, 1), collect=round(t_collect, 1), kmeans=round(t_fit, 1)),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), package_version=__version__,
        torch=torch.__version__, model=str(model or "smollm2"),
    )
    art = Artifact(fp, formats, layer_methods, calibration, stats, books, mse_tables, cost_tables)
    art.save(output)
    shutil.rmtree(work, ignore_errors=True)
    log(summary(art, output))
    return art


def summary(art: Artifact, path: Path) -> str:
    c = art.calibration
    lines = [
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {c['seconds']['total']:.0f} s "
        f"(collect {c['seconds']['collect']:.0f} s, k-means {c['seconds']['kmeans']:.0f} s)",
        f"{'format':18} {'bits':>4} {'centroids (fp16)':>17}  hybrid: channel-chunked layers",
    ]
    for name in art.formats:
        fmt = get_format(name)
        lm = art.layer_methods[name]
        hyb = ""
        if fmt.hybrid:
            ks = [i for i, m in enumerate(lm["k"]) if m == "channel"]
            vs = [i for i, m in enumerate(lm["v"]) if m == "channel"]
            hyb = f"K {ks or '-'}  V {vs or '-'}"
        lines.append(f"{name:18} {fmt.nominal_bits:>4} {art.centroid_bytes(name) / 2**20:>13.2f} MiB  {hyb}")
    return "\n".join(lines)


def _same_stats(a: Artifact, b: Artifact, rtol: float = 1e-3, atol: float = 1e-4) -> bool:
    return set(a.stats) == set(b.stats) and all(
        torch.allclose(getattr(a.stats[k], n), getattr(b.stats[k], n), rtol=rtol, atol=atol)
        for k in a.stats for n in ("mean", "std", "lo", "hi"))


def extend_artifact(path: str | Path, formats: list[str], *, model: str | None = None, device: str = "auto",
                    progress: bool = True, log=print) -> Artifact:
    """Add ``formats`` to the artifact at ``path`` without losing what it holds: the new formats'
    codebooks are fitted with the settings the artifact records (same text, windows, iterations,
    seed, so the same per-channel statistics) and merged in; if the statistics do not come out the
    same (other text, other software), every format is re-calibrated with those settings."""
    path = Path(path)
    old = Artifact.load(path)
    parts = dict.fromkeys(p for f in formats for p in get_format(f).calibrated_formats)  # a mixed format: its parts
    new_formats = [f for f in parts if f not in old.formats]
    if not new_formats:
        return old
    c = old.calibration
    kw = dict(model=model, data=c.get("data", "wiki-leads"), num_samples=c.get("num_samples"),
              seq_len=c.get("seq_len", 2048), iters=c.get("iters", 50), seed=c.get("seed", 0),
              fisher=c.get("fisher", True), attention=c.get("attention", "eager"),
              low_memory=bool(c.get("low_memory", False)), rotation=c.get("rotation"), device=device,
              progress=progress,
              log=log)
    tmp = path.with_name(path.stem + ".extend.safetensors")
    new = run_calibration(formats=new_formats, output=tmp, **kw)
    if new.fingerprint != old.fingerprint or not _same_stats(old, new):
        log(f"the per-channel statistics differ from those {path} was made with: re-calibrating all of "
            f"{', '.join(old.formats + new_formats)} with its settings")
        art = run_calibration(formats=old.formats + new_formats, output=tmp, **kw)
    else:
        books = dict(new.codebooks)
        books.update(old.codebooks)  # a family both hold: keep the served one
        calibration = dict(c)
        calibration["codebooks"] = list(dict.fromkeys(list(c.get("codebooks") or []) + list(new.calibration["codebooks"])))
        calibration["extended"] = list(c.get("extended") or []) + [
            {"formats": new_formats, "seconds": new.calibration["seconds"], "created": new.calibration["created"]}]
        art = Artifact(old.fingerprint, old.formats + new_formats, {**old.layer_methods, **new.layer_methods},
                       calibration, old.stats, books, {**old.mse, **new.mse}, {**old.cost, **new.cost})
    art.save(path)
    tmp.unlink(missing_ok=True)
    log(summary(art, path))
    return art
