"""The thesis's simulated KV compression inside a HuggingFace model, as a reference for the served formats.

Inside a HuggingFace model, the pre-RoPE K and V of every layer are replaced by their quantized-
then-decoded values (hooks on the projections, so RoPE is applied after decoding, as in the thesis);
the first SINK_TOKENS tokens stay in half precision.  A configuration is named as the quality benchmark
names it (``benchmarks/quality.py``): ``bf16``, a format, ``<format>-o1`` (1% outliers), ``<format>@<ablation>``.
Used by the quality, Fisher and needle benchmarks and by the tests that compare a server with its reference.
"""

from __future__ import annotations

import collections
import functools
import re

import torch

from vllm_temporalkv.artifact import Artifact
from vllm_temporalkv.cache import model_quantizers
from vllm_temporalkv.codecs import calibration_free_quantizers
from vllm_temporalkv.codecs.rotation import rotate
from vllm_temporalkv.formats import get_format
from vllm_temporalkv.hf_hooks import kv_output_hooks
from vllm_temporalkv.methods import outlier_fraction

KV_DTYPE = torch.bfloat16


_ABLATION_PART = re.compile(
    r"unweighted|sinks-compressed|sinks\d+|pure-temporal|(keys|values)-channel|keys-only|values-only|window\d+"
    r"|layers\d+-\d+")


def ablation_parts(ablation: str | None) -> list[str]:
    """'keys-only+layers0-5' -> ['keys-only', 'layers0-5']: an ablation may combine parts with '+'; an unknown part
    is an error (a misspelt one would otherwise measure the plain format)."""
    parts = [p for p in (ablation or "").split("+") if p]
    bad = [p for p in parts if not _ABLATION_PART.fullmatch(p)]
    if bad:
        raise ValueError(f"unknown ablation {'+'.join(bad)!r}; known: unweighted, sinks-compressed, sinksN, "
                         "pure-temporal, keys-channel, values-channel, keys-only, values-only, windowN, layersA-B "
                         "(joined with '+')")
    return parts


def window_of(fmt: str, ablation: str | None) -> int:
    """The recent window a configuration keeps: ``@windowN``, else the format's own."""
    for p in ablation_parts(ablation):
        if p.startswith("window"):
            return int(p.removeprefix("window"))
    return get_format(fmt).window


def sinks_of(ablation: str | None) -> int | None:
    """The exact first tokens a configuration keeps: ``@sinksN`` (a remedy: more attention sinks), 0 with
    ``@sinks-compressed``, else None (the format's SINK_TOKENS)."""
    for p in ablation_parts(ablation):
        if p == "sinks-compressed":
            return 0
        if p.startswith("sinks"):
            return int(p.removeprefix("sinks"))
    return None


def layers_of(ablation: str | None) -> range | None:
    """``@layersA-B``: only layers A..B (inclusive) compressed, the others exact; None = every layer."""
    for p in ablation_parts(ablation):
        if p.startswith("layers"):
            a, b = map(int, p.removeprefix("layers").split("-"))
            return range(a, b + 1)
    return None


OUTLIER_SUFFIX = re.compile(r"-o(\d+(?:\.\d+)?)$")  # "<format>-o<percent of values kept exact>"


def parse_config(name: str) -> tuple[str | None, bool | float, str | None]:
    """'temporalkv-2bit-o1@x' -> ('temporalkv-2bit', True, 'x') (1% outliers); '-o0.5': 0.005 (that share,
    ``methods.outlier_fraction``); 'bf16' -> (None, False, None)."""
    base, _, ablation = name.partition("@")
    if base == "bf16":
        return None, False, None
    m = OUTLIER_SUFFIX.search(base)
    if m is None:
        return base, False, ablation or None
    pct = float(m.group(1))
    return base[: m.start()], True if pct == 1 else pct / 100, ablation or None


class Simulator:
    """Fake-quant hook for one configuration.

    protocol "thesis": the hook replaces K/V by their decoded values, for every query.
    protocol "causal": what a decode step of the server sees - a query attends to decoded K/V of
    the blocks completed before its own block, and to exact K/V of its own (incomplete) block; the
    hook keeps K/V exact and stashes the decoded values for ``causal_attention``.

    A recent window (the selective formats, ``@windowN``) keeps the last tokens exact as the server does:
    thesis protocol, those of the whole window; causal, those of each query (``layout.exact_from``)."""

    def __init__(self, name: str, art: Artifact, art_unweighted: Artifact | None, protocol: str = "thesis"):
        fmt, outliers, ablation = parse_config(name)
        outlier_fraction(outliers)  # a share over 1% is refused here, not deep in the first encode
        self.protocol = protocol
        parts = ablation_parts(ablation)
        self.sinks = sinks_of(ablation)
        self.rotation = {}  # an artifact fitted on rotated K / V (codecs/rotation.py): rotate, code, rotate back
        # the diagnosis of where a format loses: only keys or only values compressed, the other half exact
        self.exact_kind = {"keys-only": "v", "values-only": "k"}.get(next((p for p in parts if p.endswith("-only")), None))
        self.layers = layers_of(ablation)  # per-layer sensitivity: one layer group compressed at a time
        self.qs = None
        self.window = 0
        self.stash: dict[tuple[int, str], torch.Tensor] = {}
        if fmt is not None:
            self.window = window_of(fmt, ablation)
            f = get_format(fmt)
            if f.per_layer_pages and not f.needs_calibration:  # QJL: per-layer sketches, keys rotated by the model's
                # RoPE - built in bind()
                self.qs, self._free = {}, f
                return
            if not f.needs_calibration:
                pair = calibration_free_quantizers(f)
                self.qs = collections.defaultdict(lambda: pair)  # the same (stateless) pair for every layer
                return
            src = art_unweighted if "unweighted" in parts else art
            methods = None
            if "pure-temporal" in parts:
                methods = {kv: ["temporal"] * art.num_layers for kv in "kv"}
            for kind, kv in (("keys", "k"), ("values", "v")):  # one half channel-chunked in every layer
                if f"{kind}-channel" in parts:
                    if fmt not in src.layer_methods:
                        raise ValueError(f"@{kind}-channel: {fmt} has no per-layer chunking of its own (a K/V pair "
                                         "or mixed format): give one of the uniform formats")
                    methods = dict(methods or src.layer_methods[fmt])
                    methods[kv] = ["channel"] * art.num_layers
            self.qs = model_quantizers(fmt, src, outliers=outliers, methods=methods)
            self.rotation = src.rotation

    def bind(self, hf_config) -> None:
        """The model's facts a per-layer format needs (token_nlls calls it): QJL's quantizers per layer."""
        f = getattr(self, "_free", None)
        if f is not None and not self.qs:
            from vllm_temporalkv.artifact import model_fingerprint
            from vllm_temporalkv.rope import Rope

            fp, rope = model_fingerprint(hf_config), Rope(hf_config)
            self.qs = {i: calibration_free_quantizers(f, head_dim=fp["head_dim"], layer=i, rope=rope)
                       for i in range(fp["num_layers"])}

    def __call__(self, layer: int, kind: str, out: torch.Tensor) -> torch.Tensor:
        x = out.to(KV_DTYPE)
        if self.qs is not None and kind != self.exact_kind and (self.layers is None or layer in self.layers):
            q = self.qs[layer][0 if kind == "k" else 1]
            kw = {} if self.sinks is None else {"sinks": self.sinks}
            # causal: every whole block decoded (which ones a query sees exactly is causal_attention's business)
            kw["window"] = self.window if self.protocol == "thesis" else 0
            rot = self.rotation.get(kind)
            # rotated in float32 both ways: the exact tokens (sinks, tail) come back to within their half precision
            xr = x.float() if rot else x
            xq = torch.stack([q.fake_quant(rotate(xr[b], rot), **kw) for b in range(x.shape[0])])
            if rot:  # (a format's own decode keeps its dtype: QJL's keys are exact post-RoPE, not here)
                xq = rotate(xq, rot, inverse=True).to(KV_DTYPE)
            if self.protocol == "causal":
                self.stash[(layer, kind)] = xq.to(out.dtype)
            else:
                x = xq
        elif self.qs is not None and self.protocol == "causal":
            self.stash[(layer, kind)] = x.to(out.dtype)
        return x.to(out.dtype)


_ACTIVE: dict = {}


@functools.lru_cache(maxsize=4)
def _future(T: int, device) -> torch.Tensor:
    """[T, T] True where a key lies after its query (made once per length: every layer masks with it)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu_(1)


def causal_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention function for protocol "causal" (see Simulator).

    A query attends to decoded keys and values, except those of its own (incomplete) block and the recent window
    before it, which it sees exactly.  Those exact keys lie within window + BLOCK_TOKENS - 1 of the diagonal, so
    the decoded scores are computed once for the whole matrix and the exact ones written over that band, one
    diagonal at a time: one full-size matmul per side rather than two (the tests' reference scorings of 1500 tokens
    spent most of their time here).  A KV head's g query heads are reshaped onto it rather than repeating K and V."""
    from vllm_temporalkv.formats import BLOCK_TOKENS

    sim, rope = _ACTIVE["sim"], _ACTIVE["rope"]
    layer = module.layer_idx
    B, Hq, T, D = query.shape
    Hk = key.shape[1]
    g = Hq // Hk
    probe = _ACTIVE.get("probe")
    if sim.qs is None and probe is None:  # nothing compressed: plain causal attention
        out = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), is_causal=True, scale=scaling, enable_gqa=True)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    if sim.qs is None:
        kq, vq = key, value
    else:
        pos = torch.arange(T, device=query.device)
        kq = torch.stack([rope.apply(sim.stash[(layer, "k")][b], pos) for b in range(B)]).transpose(1, 2)
        vq = sim.stash[(layer, "v")].transpose(1, 2)
    # the g query heads of a KV head side by side (repeat_interleave's order), scaled here rather than the scores
    q = (query.float() * scaling).reshape(B, Hk, g, T, D)
    k, v = key.float()[:, :, None], value.float()[:, :, None]  # [B, Hk, 1, T, D]
    s = torch.matmul(q, kq.float()[:, :, None].transpose(3, 4)).reshape(B, Hq, T, T)
    rows = torch.arange(T, device=query.device)
    first_exact = (rows - sim.window) // BLOCK_TOKENS * BLOCK_TOKENS  # the query's own block and the recent window
    out = torch.zeros(B, Hk, g, T, D, dtype=torch.float32, device=query.device)
    diagonals = []
    for w in range(min(T, sim.window + BLOCK_TOKENS)):  # key i - w of query i, for i = w .. T - 1
        own = first_exact[w:] <= rows[: T - w]
        exact = (q[:, :, :, w:] * k[:, :, :, : T - w]).sum(-1).reshape(B, Hq, T - w)
        d = s.diagonal(-w, -2, -1)  # a view: written in place
        d.copy_(torch.where(own, exact, d))
        diagonals.append((w, own, exact))
    p = torch.softmax(s.masked_fill_(_future(T, query.device), float("-inf")), -1)
    if probe is not None:  # benchmarks.needle_nll: how one query's attention finds the needle's tokens
        qi, span = probe["query"], probe["span"]
        # computed as the served scores are (the same matmul, the own keys from the same diagonals): where nothing
        # is compressed the two agree bit for bit
        exact = torch.matmul(q, k.transpose(3, 4)).reshape(B, Hq, T, T)[0, :, qi, : qi + 1].clone()
        for w, own, ex in diagonals:
            if w <= qi and own[qi - w]:
                exact[:, qi - w] = ex[0, :, qi - w]
        served = s[0, :, qi, : qi + 1]  # [Hq, keys]: the scores as served
        probe["layers"][layer] = {name: needle_attention(x, span) for name, x in (("exact", exact), ("served", served))}
    for w, own, _ in diagonals:  # the exact keys' share, then their probability taken off the decoded values' share
        d = p.diagonal(-w, -2, -1)
        out[:, :, :, w:] += (d * own).reshape(B, Hk, g, T - w, 1) * v[:, :, :, : T - w]
        d.masked_fill_(own, 0.0)
    out += torch.matmul(p.reshape(B, Hk, g, T, T), vq.float()[:, :, None])
    return out.reshape(B, Hq, T, D).to(query.dtype).transpose(1, 2).contiguous(), None


def needle_attention(scores: torch.Tensor, span: list[int]) -> dict[str, list[float]]:
    """Per head, from one query's scores [Hq, keys]: the attention mass on the span's keys, and the rank of its best
    key (how many keys score higher: 0 = the needle is the top key)."""
    best = scores[:, span].amax(-1, keepdim=True)
    return {"mass": torch.softmax(scores, -1)[:, span].sum(-1).tolist(),
            "rank": (scores > best).sum(-1).tolist()}


@torch.no_grad()
def token_nlls(model, ids: torch.Tensor, hook) -> torch.Tensor:
    """Next-token NLL of every token of ids [T] after the first ([T - 1], float32) under a hook."""
    if hasattr(hook, "bind"):
        hook.bind(model.config)
    if getattr(hook, "protocol", "thesis") == "causal":
        from transformers import AttentionInterface

        from vllm_temporalkv.rope import Rope

        AttentionInterface.register("tkv_causal", causal_attention)
        _ACTIVE.update(sim=hook, rope=Rope(model.config))
        model.set_attn_implementation("tkv_causal")
    else:
        model.set_attn_implementation("eager")
    with kv_output_hooks(model, hook):
        x = ids[None].to(model.device)
        logits = model(x).logits.float()
        return torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none").cpu()


def window_nll(model, windows: torch.Tensor, hook) -> tuple[float, int]:
    """Summed next-token NLL and token count over windows [N, T]."""
    nll, count = 0.0, 0
    for w in windows:
        t = token_nlls(model, w, hook)
        nll += float(t.sum())
        count += t.numel()
    return nll, count
