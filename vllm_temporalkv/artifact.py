"""The calibration artifact: one safetensors file per model, never unpickled.

Tensors
    ``stats.<layer>.<k|v>.{mean,std,lo,hi}``   [H, D] float32  per-channel statistics, thresholds
    ``codebook.<layer>.<k|v>.<key>``           [H, G, K, v] float16  e.g. key ``temporal-l4-k256``
    ``hybrid.<format>.mse``                    [L, 2, 2] float32  Fisher-MSE (K/V x temporal/channel)
    ``hybrid.<format>.cost``                   [L, 2, 2] float32  the diagonal-Fisher estimate of the LM loss
                                                                  increase per token (nats; calibration.fit.fisher_error),
                                                                  what a mixed format's per-layer choice reads
Metadata (JSON strings)
    ``kind``, ``schema_version``, ``fingerprint`` (the model), ``formats``, ``layer_methods``
    (the hybrid's per-layer chunking, K and V separately), ``calibration`` (data and arguments).

Loading checks everything a server relies on and fails with an ``ArtifactError`` that names the
file, the problem and the command that fixes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .codecs import make_codec
from .codecs.quantizer import ChannelStats
from .formats import KVFormat, get_format, parse_codebook_key
from .mixed import MissingCosts, choose_layer_formats

KIND = "vllm-temporalkv/calibration"
SCHEMA_VERSION = 1
# a subfolder: vLLM loads every top-level *.safetensors of a model folder as weights
ARTIFACT_RELPATH = "temporalkv/calibration.safetensors"
ENV_ARTIFACT = "VLLM_TEMPORALKV_ARTIFACT"
KV = ("k", "v")
DIGEST_KEY = "content_sha256"  # metadata: SHA-256 of everything else (absent in files written before it)
STAT_NAMES = ("mean", "std", "lo", "hi")


def content_digest(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the metadata (but the digest itself) and every tensor's name, dtype, shape and bytes:
    a flipped bit anywhere, a swapped pair of tensors or an edited fingerprint no longer matches."""
    h = hashlib.sha256()
    for k in sorted(meta):
        if k != DIGEST_KEY:
            h.update(json.dumps([k, meta[k]]).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ArtifactError(ValueError):
    """A calibration artifact is missing, unreadable or does not fit the model."""


def calibrate_hint(model: str | None = None, output: str | Path | None = None) -> str:
    cmd = "temporalkv-calibrate"
    if model:
        cmd += f" --model {model}"
    if output:
        cmd += f" --output {output}"
    return cmd


# --------------------------------------------------------------------------------------------
# model fingerprint


def _cfg_get(cfg: Any, name: str, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def model_fingerprint(cfg: Any) -> dict:
    """What an artifact must agree on with the model it serves (from an HF config or its dict)."""
    text = _cfg_get(cfg, "text_config")
    if text is not None and _cfg_get(cfg, "num_hidden_layers") is None:
        cfg = text
    heads = int(_cfg_get(cfg, "num_attention_heads"))
    hidden = int(_cfg_get(cfg, "hidden_size"))
    head_dim = _cfg_get(cfg, "head_dim") or hidden // heads
    rope = dict(_cfg_get(cfg, "rope_parameters") or _cfg_get(cfg, "rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or _cfg_get(cfg, "rope_theta")
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    archs = _cfg_get(cfg, "architectures") or [_cfg_get(cfg, "model_type")]
    return {
        "architecture": str(archs[0]),
        "num_layers": int(_cfg_get(cfg, "num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(_cfg_get(cfg, "num_key_value_heads") or heads),
        "head_dim": int(head_dim),
        "hidden_size": hidden,
        "vocab_size": int(_cfg_get(cfg, "vocab_size")),
        "rope_theta": float(theta) if theta is not None else None,
        "rope_type": str(rope_type),
        "rope_scaling": {k: rope[k] for k in sorted(rope)},
    }


def fingerprint_mismatch(expected: dict, found: dict) -> list[str]:
    return [
        f"{k}: artifact has {found.get(k)!r}, model has {expected.get(k)!r}"
        for k in sorted(set(expected) | set(found))
        if expected.get(k) != found.get(k)
    ]


# --------------------------------------------------------------------------------------------
# the artifact


@dataclasses.dataclass
class Artifact:
    fingerprint: dict
    formats: list[str]
    layer_methods: dict[str, dict[str, list[str]]]  # format -> {"k": [...], "v": [...]}
    calibration: dict
    stats: dict[tuple[int, str], ChannelStats]
    codebooks: dict[tuple[int, str, str], torch.Tensor]  # (layer, k|v, key) -> [H, G, K, v]
    mse: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    cost: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # format -> [L, 2, 2] (absent: older)
    path: Path | None = None
    _layer_formats: dict[str, list[str]] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return self.fingerprint["num_layers"]

    @property
    def rotation(self) -> dict[str, str]:
        """{"k" / "v": rotation} the codebooks of keys / values were fitted under (``calibrate --rotate``,
        codecs/rotation.py); empty for none: decoded vectors must be rotated back (keys before RoPE)."""
        return dict(self.calibration.get("rotation") or {})

    # ---- save / load -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        for (layer, kv), s in self.stats.items():
            for name in ("mean", "std", "lo", "hi"):
                tensors[f"stats.{layer}.{kv}.{name}"] = getattr(s, name).float().contiguous()
        for (layer, kv, key), c in self.codebooks.items():
            tensors[f"codebook.{layer}.{kv}.{key}"] = c.half().contiguous()
        for fmt, m in self.mse.items():
            tensors[f"hybrid.{fmt}.mse"] = m.float().contiguous()
        for fmt, m in self.cost.items():
            tensors[f"hybrid.{fmt}.cost"] = m.float().contiguous()
        meta = {
            "kind": KIND,
            "schema_version": str(SCHEMA_VERSION),
            "fingerprint": json.dumps(self.fingerprint),
            "formats": json.dumps(self.formats),
            "layer_methods": json.dumps(self.layer_methods),
            "calibration": json.dumps(self.calibration),
        }
        meta[DIGEST_KEY] = content_digest(meta, tensors)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)  # never leave a half-written artifact under the real name
        self.path = path
        return path

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        expect: dict | None = None,
        formats: list[str] | None = None,
        model_hint: str | None = None,
    ) -> "Artifact":
        """Read and validate. ``expect``: the model's fingerprint; ``formats``: must be covered."""
        from safetensors import safe_open

        path = Path(path)
        fix = calibrate_hint(model_hint, path)
        if not path.is_file():
            raise ArtifactError(f"calibration artifact not found: {path}. Create it with: {fix}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for bad headers / short files
            raise ArtifactError(
                f"calibration artifact {path} is unreadable (truncated or corrupt: {e}). "
                f"Delete it and re-create it with: {fix}"
            ) from None
        if meta.get("kind") != KIND:
            raise ArtifactError(
                f"{path} is a safetensors file but not a vllm-temporalkv calibration artifact "
                f"(metadata kind={meta.get('kind')!r}). Create one with: {fix}"
            )
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise ArtifactError(
                f"calibration artifact {path} has schema version {meta.get('schema_version')!r}; "
                f"this vllm-temporalkv reads version {SCHEMA_VERSION}. Re-create it with: {fix}"
            )
        digest = meta.get(DIGEST_KEY)
        if digest is not None and digest != content_digest(meta, tensors):
            raise ArtifactError(
                f"calibration artifact {path} is corrupt: its content does not match the checksum written with "
                f"it ({DIGEST_KEY}). Delete it and re-create it with: {fix}"
            )
        try:
            art = cls(
                fingerprint=json.loads(meta["fingerprint"]),
                formats=json.loads(meta["formats"]),
                layer_methods=json.loads(meta["layer_methods"]),
                calibration=json.loads(meta.get("calibration", "{}")),
                stats={},
                codebooks={},
                path=path,
            )
            art._check_metadata()
        except (KeyError, ValueError, TypeError) as e:
            raise ArtifactError(f"calibration artifact {path} has corrupt metadata ({type(e).__name__}: {e}). "
                                f"Re-create it with: {fix}") from None
        if expect is not None:
            diff = fingerprint_mismatch(expect, art.fingerprint)
            if diff:
                raise ArtifactError(
                    f"calibration artifact {path} was made for a different model ("
                    + "; ".join(diff)
                    + f"). Calibrate this model with: {fix}"
                )
        art._fill(tensors, fix)
        for name in formats or []:
            for part in get_format(name).calibrated_formats:
                if part not in art.formats:
                    raise ArtifactError(
                        f"calibration artifact {path} has no codebooks for {part}{f' (a part of {name})' if part != name else ''} "
                        f"(it covers {', '.join(art.formats) or 'nothing'}). Re-create it with: {fix} --formats {name}"
                    )
            if get_format(name).mix:
                art.layer_formats(name, fix)  # the per-layer choice must be computable: the parts' costs
        return art

    def _check_metadata(self) -> None:
        """Types and values of the JSON metadata (raises ValueError / TypeError, turned into an
        ArtifactError by ``load``)."""
        fp = self.fingerprint
        if not isinstance(fp, dict):
            raise TypeError(f"fingerprint is {type(fp).__name__}, not an object")
        for key in ("num_kv_heads", "head_dim", "num_layers"):
            if not isinstance(fp.get(key), int) or isinstance(fp.get(key), bool) or fp[key] <= 0:
                raise ValueError(f"fingerprint {key} = {fp.get(key)!r}")
        if not isinstance(self.formats, list) or not self.formats:
            raise ValueError(f"formats = {self.formats!r}, expected a non-empty list of format names")
        if len(set(map(str, self.formats))) != len(self.formats):
            raise ValueError(f"formats = {self.formats!r} lists a format twice")
        for name in self.formats:
            if not isinstance(name, str):
                raise TypeError(f"format name {name!r}")
            get_format(name)  # FormatError (a ValueError) for an unknown one
        if not isinstance(self.layer_methods, dict):
            raise TypeError(f"layer_methods is {type(self.layer_methods).__name__}, not an object")
        if not isinstance(self.calibration, dict):
            raise TypeError(f"calibration is {type(self.calibration).__name__}, not an object")
        for name in self.formats:
            fmt = get_format(name)
            allowed = {fmt.method, "channel"} if fmt.hybrid else {fmt.method}
            methods = self.layer_methods.get(name)
            if not isinstance(methods, dict):
                raise ValueError(f"per-layer method choice of {name} missing")
            for kv in KV:
                ms = methods.get(kv)
                if not isinstance(ms, list) or len(ms) != fp["num_layers"]:
                    raise ValueError(f"per-layer method choice of {name} {kv.upper()} missing or not "
                                     f"{fp['num_layers']} layers long")
                bad = [m for m in ms if m not in allowed]
                if bad:
                    raise ValueError(f"per-layer method choice of {name} {kv.upper()} has {bad[0]!r} "
                                     f"(allowed: {', '.join(sorted(allowed))})")

    def _fill(self, tensors: dict[str, torch.Tensor], fix: str) -> None:
        fp = self.fingerprint
        H, D, L = fp["num_kv_heads"], fp["head_dim"], fp["num_layers"]
        stats: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

        def bad(msg):
            return ArtifactError(f"calibration artifact {self.path} is inconsistent: {msg}. Re-create it with: {fix}")

        def layer_of(name: str, part: str) -> int:
            if not part.isdigit() or not 0 <= int(part) < L:
                raise bad(f"tensor {name!r} names layer {part!r} (the model has {L})")
            return int(part)

        for name, t in tensors.items():
            parts = name.split(".")
            if parts[0] == "stats" and len(parts) == 4 and parts[2] in KV and parts[3] in STAT_NAMES:
                if t.dtype != torch.float32:
                    raise bad(f"statistics {name} are {t.dtype}, expected torch.float32")
                stats.setdefault((layer_of(name, parts[1]), parts[2]), {})[parts[3]] = t
            elif parts[0] == "codebook" and len(parts) == 4 and parts[2] in KV:
                if t.dtype != torch.float16:
                    raise bad(f"codebook {name} is {t.dtype}, expected torch.float16")
                self.codebooks[(layer_of(name, parts[1]), parts[2], parts[3])] = t
            elif parts[0] == "hybrid" and len(parts) == 3 and parts[2] in ("mse", "cost"):
                if parts[2] == "cost" and (t.dtype != torch.float32 or tuple(t.shape) != (L, 2, 2)
                                           or not torch.isfinite(t).all() or (t < 0).any()):
                    raise bad(f"{name} must be finite, >= 0, float32 of shape {(L, 2, 2)}")
                getattr(self, parts[2])[parts[1]] = t
            else:
                raise bad(f"unexpected tensor {name!r}")

        for layer in range(L):
            for kv in KV:
                s = stats.get((layer, kv), {})
                if set(s) != {"mean", "std", "lo", "hi"}:
                    raise bad(f"statistics of layer {layer} {kv.upper()} missing")
                for t in s.values():
                    if tuple(t.shape) != (H, D):
                        raise bad(f"layer {layer} {kv.upper()} statistics have shape {tuple(t.shape)}, expected {(H, D)} (KV heads x head_dim)")
                    if not torch.isfinite(t).all():
                        raise bad(f"layer {layer} {kv.upper()} statistics have non-finite values")
                if not (s["std"] > 0).all():
                    raise bad(f"layer {layer} {kv.upper()} has a channel with standard deviation <= 0")
                self.stats[(layer, kv)] = ChannelStats(s["mean"], s["std"], s["lo"], s["hi"])
        for name in self.formats:
            fmt = get_format(name)
            for layer in range(L):
                for kv in KV:
                    key = self.codebook_key(fmt, layer, kv)
                    c = self.codebooks.get((layer, kv, key))
                    method, chunk, k = parse_codebook_key(key)
                    want = make_codec(method, chunk, k).codebook_shape(H, D)
                    if c is None:
                        raise bad(f"codebook {key} of layer {layer} {kv.upper()} (needed by {name}) missing")
                    if tuple(c.shape) != want:
                        raise bad(f"codebook {key} of layer {layer} {kv.upper()} has shape {tuple(c.shape)}, expected {want}")
                    if not torch.isfinite(c).all():
                        raise bad(f"codebook {key} of layer {layer} {kv.upper()} has non-finite values")

    # ---- use -------------------------------------------------------------------------------------
    def layer_formats(self, format_name: str, fix: str | None = None) -> list[str]:
        """Which format serves each layer: the format itself, or for a mixed one (``KVFormat.mix``) the part the
        mixed-format policy (mixed.py) chooses from this calibration's per-layer loss estimates."""
        fmt = get_format(format_name)
        if not fmt.mix:
            return [format_name] * self.num_layers
        cached = self._layer_formats.get(format_name)
        if cached is None:
            try:
                cached = choose_layer_formats(fmt, self.num_layers, self.cost, self.method_of)
            except MissingCosts as e:
                raise ArtifactError(
                    f"calibration artifact {self.path} has no per-layer loss estimates for {', '.join(e.parts)} "
                    f"(written before they were recorded): {format_name} chooses its layers' chunk lengths from them. "
                    f"Re-create it with: {fix or calibrate_hint(None, self.path)} --formats {' '.join(fmt.mix)}"
                ) from None
            self._layer_formats[format_name] = cached
        return cached

    def method_of(self, fmt: KVFormat, layer: int, kv: str) -> str:
        return self.layer_methods[fmt.part(kv).name][kv][layer]  # a K/V pair: its half's hybrid choice

    def codebook_key(self, fmt: KVFormat, layer: int, kv: str) -> str:
        fmt = fmt.part(kv)
        if fmt.hybrid and self.method_of(fmt, layer, kv) == "channel":
            return fmt.channel_twin_key
        return fmt.codebook_key

    def codebook(self, fmt: KVFormat, layer: int, kv: str, heads: list[int] | None = None, method: str | None = None):
        """(method, codebooks [H, G, K, v], ChannelStats) of one layer's K ("k") or V ("v") for a (non-mixed)
        format (a K/V pair: that half's), at the layer's hybrid choice unless ``method`` overrides it (the
        pure-temporal ablation); ``heads``: only these KV heads, in this order (a tensor-parallel rank's own)."""
        if not 0 <= layer < self.num_layers:
            raise ArtifactError(f"calibration artifact {self.path} has {self.num_layers} layers; layer {layer} asked for")
        missing = [p for p in fmt.calibrated_formats if p not in self.formats]
        if missing:
            raise ArtifactError(f"calibration artifact {self.path} has no codebooks for {', '.join(missing)} "
                                f"(needed by {fmt.name}); add them with: {calibrate_hint(None, self.path)} "
                                f"--formats {' '.join(missing)}")
        part = fmt.part(kv)
        method = method or self.method_of(fmt, layer, kv)
        key = part.channel_twin_key if method == "channel" and part.hybrid else part.codebook_key
        if (layer, kv, key) not in self.codebooks:
            raise ArtifactError(f"calibration artifact {self.path} lacks codebook {key} for layer {layer} {kv.upper()}")
        books, stats = self.codebooks[(layer, kv, key)], self.stats[(layer, kv)]
        if heads is not None:
            if not all(0 <= h < books.shape[0] for h in heads):
                raise ArtifactError(f"calibration artifact {self.path} has {books.shape[0]} KV heads; heads "
                                    f"{heads} asked for")
            books = books[heads]
            stats = ChannelStats(*(t[heads] for t in (stats.mean, stats.std, stats.lo, stats.hi)))
        return method, books, stats

    def centroid_bytes(self, format_name: str) -> int:
        """fp16 bytes of the codebooks a server needs for this format (all layers, K and V)."""
        parts = self.layer_formats(format_name)
        return sum(
            self.codebooks[(layer, kv, self.codebook_key(get_format(parts[layer]), layer, kv))].numel() * 2
            for layer in range(self.num_layers)
            for kv in KV
        )


def default_artifact_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / ARTIFACT_RELPATH
