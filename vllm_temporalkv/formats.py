"""The registry of KV-cache formats: one place that says what each `--kv-cache-dtype` name means.

Every format quantizes K and V of every layer / KV head with a codebook (vector quantization with
one code per vector), after per-channel normalization.  They differ in what a *vector* is:

* ``temporal`` (TemporalKV, the thesis): ``l`` consecutive tokens of one channel; 256 centroids,
  one uint8 code per vector -> 8/l bits per float.  Codebooks are shared by groups of ``l``
  adjacent channels (so centroid memory equals ChannelKV's, as in the thesis).
* ``channel`` (ChannelKV = Coupled Quantization, seed 001): one token, ``l`` adjacent channels;
  256 centroids per channel group.
* ``scalar`` (KVQuant-style non-uniform datatype): one value; 2**bits centroids per channel.

and two format families need no calibration at all:
* ``selective`` (seed 003, "Don't Drop It, Compress It"): every token per token symmetric int8 / int4
  with an fp16 absmax scale, behind a recent window of ``window`` tokens kept in half precision.
* ``tada`` (seed 004, TaDA): per token the mean over the KV heads in 16 bits, each head's deviation from it
  asymmetric 4 / 2-bit (an fp16 scale + min per 128 channels), behind a recent window (the paper's residual).
* ``qjl`` (seed 002, QJL): keys as 1-bit JL sketches of the post-RoPE key + norms (a larger sketch in the first
  15 layers: its pages differ per layer, ``per_layer_pages``), values asymmetric 2-bit per 32 channels, behind a
  128-token recent window (the official code's buffer).  K and V are laid out differently (layout.PageLayout).

and two ways to spend bits unevenly, both served from the codebooks of the uniform formats they are made of:
* a *mixed* format (``mix``): per layer one of its parts (``temporalkv-2bit-mixed``, issue 16's first remedy);
* a *K/V pair* (``kv``): keys as one format, values as another (``temporalkv-k4v2``: keys at 4 bits, values at 2;
  ``temporalkv-2bit-cv``: the hybrid's 2-bit keys, ChannelKV's 2-bit values).

Shared by all formats (so they are compared on equal terms):
* ``SINK_TOKENS`` first tokens of every sequence stay in half precision (attention sinks);
* tokens are encoded in blocks of ``BLOCK_TOKENS`` (every chunk length divides it); the newest,
  incomplete block waits in a half-precision tail - the thesis's "same small fp16 local window";
* an optional recent window (``window`` tokens, a multiple of BLOCK_TOKENS; 0 for the thesis's formats,
  the serving option ``temporalkv_recent_window`` for any): a block is encoded only once ``window`` newer
  tokens exist, so a query sees the last ``window`` to ``window + 7`` tokens exactly (layout.PageLayout);
* optional dense-and-sparse outliers: values outside per-channel calibration quantiles are kept
  exactly, at most ``outlier_cap(head_dim)`` per (block, KV head, K/V), i.e. <= 1% of values.
"""

from __future__ import annotations

import dataclasses
import re

# the constants every format shares live with the methods (methods.py); the block, sink and outlier ones are
# re-exported here, where most readers look for them
from .methods import BLOCK_TOKENS, OUTLIER_QUANTILES, SINK_TOKENS, CodeLayout, get_method, outlier_cap  # noqa: F401


@dataclasses.dataclass(frozen=True)
class KVFormat:
    name: str
    method: str  # one of methods.METHODS
    # code bits / floats per vector (the name's bits; the all-in cost with scales, sinks, tail, outliers:
    # layout.bits_per_float)
    nominal_bits: float
    chunk: int  # floats per vector: tokens (temporal), channels (channel), 1 (scalar, selective, tada)
    n_centroids: int  # codebook size; for selective and tada, the 2**bits code levels
    # per layer and K/V, calibration may choose channel chunking (same l, same bits) where its
    # Fisher-MSE is lower: the thesis's hybrid TemporalKV
    hybrid: bool = False
    window: int = 0  # recent tokens kept in half precision by default (the serving option overrides)
    # a mixed format: per layer one of these formats (same method, other chunk lengths), chosen from the
    # calibration's per-layer loss estimates under an average of ``nominal_bits`` (mixed.py)
    mix: tuple[str, ...] = ()
    # a K/V pair: keys served as format kv[0], values as kv[1] (one method, other chunk lengths; their codebooks) -
    # the bits go where a format loses most (issue 16: the needle loss is in the keys)
    kv: tuple[str, str] = ()

    def part(self, kind: str) -> "KVFormat":
        """The format that lays out and quantizes K ("k") or V ("v"): a pair's half, else the format itself."""
        return get_format(self.kv[0 if kind == "k" else 1]) if self.kv else self

    @property
    def needs_calibration(self) -> bool:
        """Codebook formats serve from a calibration artifact; the others need none."""
        return get_method(self.method).calibrated

    @property
    def per_layer_pages(self) -> bool:
        """Whether a layer's page record size depends on the layer (QJL's larger sketch in its first layers, a mixed
        format's chunk length)."""
        return get_method(self.method).post_rope_keys or bool(self.mix)

    @property
    def calibrated_formats(self) -> list[str]:
        """The formats whose codebooks an artifact needs to serve this one: itself, or a mix's / a K/V pair's parts."""
        return list(dict.fromkeys(self.mix or self.kv)) or [self.name]

    @property
    def code_layout(self) -> CodeLayout:
        """How this format's (non-hybrid) codes are laid out: ``methods.CodeLayout``."""
        if self.kv:  # K and V differ: ask part(kind)
            raise ValueError(f"{self.name} lays out K as {self.kv[0]} and V as {self.kv[1]}: use part('k' / 'v')")
        return get_method(self.method).code_layout(self.chunk, self.n_centroids)

    @property
    def codebook_key(self) -> str:
        return codebook_key(self.method, self.chunk, self.n_centroids)

    @property
    def channel_twin_key(self) -> str:
        """Codebook used by the hybrid on layers where channel chunking wins (same l, same bits)."""
        return codebook_key("channel", self.chunk, self.n_centroids)


def codebook_key(method: str, chunk: int, n_centroids: int) -> str:
    """Name of one family of codebooks inside a calibration artifact, e.g. ``temporal-l4-k256``."""
    return f"{method}-l{chunk}-k{n_centroids}"


def parse_codebook_key(key: str) -> tuple[str, int, int]:
    m = re.fullmatch(r"(temporal|channel|scalar)-l(\d+)-k(\d+)", key)
    if not m:
        raise ValueError(f"not a codebook key: {key!r}")
    return m.group(1), int(m.group(2)), int(m.group(3))


def _build() -> dict[str, KVFormat]:
    out = {}
    for bits, l in ((4, 2), (2, 4), (1, 8)):
        out[f"temporalkv-{bits}bit"] = KVFormat(f"temporalkv-{bits}bit", "temporal", bits, l, 256, hybrid=True)
        out[f"channelkv-{bits}bit"] = KVFormat(f"channelkv-{bits}bit", "channel", bits, l, 256)
        out[f"kvquant-{bits}bit"] = KVFormat(f"kvquant-{bits}bit", "scalar", bits, 1, 2**bits)
    # TaDA's idea (seed 004, per-layer bits under a budget) applied to TemporalKV's l in {2, 4, 8}: 2 bits per float
    # on average over the layers, each layer (K and V alike: the C++ kernels read one code size per layer) at 4, 2 or
    # 1 bits where the calibration's Fisher estimate of the loss increase says it pays (issue 16's remedy)
    out["temporalkv-2bit-mixed"] = KVFormat("temporalkv-2bit-mixed", "temporal", 2, 4, 256, hybrid=True,
                                            mix=("temporalkv-4bit", "temporalkv-2bit", "temporalkv-1bit"))
    # K/V pairs: keys at more bits than values, where the 2-bit needle loss is (README, issue 16); the nominal bits
    # are the mean of the halves'
    for kb, vb in ((4, 2), (4, 1)):
        k, v = out[f"temporalkv-{kb}bit"], out[f"temporalkv-{vb}bit"]
        name = f"temporalkv-k{kb}v{vb}"
        out[name] = dataclasses.replace(k, name=name, nominal_bits=(kb + vb) / 2, kv=(k.name, v.name))
    # issue 35's remedy on Qwen2.5-1.5B: the hybrid's keys, values channel-chunked in every layer (ChannelKV's codes,
    # from the same channel codebooks the hybrid holds): the hybrid's per-layer choice of temporal values, right by
    # the Fisher-weighted MSE, costs perplexity there (brown, 2 windows: 1.108x bf16 against the hybrid's 1.145x)
    out["temporalkv-2bit-cv"] = dataclasses.replace(out["temporalkv-2bit"], name="temporalkv-2bit-cv",
                                                    kv=("temporalkv-2bit", "channelkv-2bit"))
    for bits in (8, 4):
        out[f"selective-int{bits}"] = KVFormat(f"selective-int{bits}", "selective", bits, 1, 2**bits,
                                               window=get_method("selective").window)
    for bits in (4, 2):  # uniform deviation bits; the paper's per-layer mix is the quality harness's (tada-mixed-3bit)
        out[f"tada-{bits}bit"] = KVFormat(f"tada-{bits}bit", "tada", bits, 1, 2**bits,
                                          window=get_method("tada").window)
    # nominal_bits / n_centroids: the values' 2-bit codes; the keys' sketch bits are the layout's (key_block_bytes)
    out["qjl"] = KVFormat("qjl", "qjl", 2, 1, 4, window=get_method("qjl").window)
    return out


FORMATS: dict[str, KVFormat] = _build()


class FormatError(ValueError):
    pass


def get_format(name: str) -> KVFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(
            f"unknown KV format {name!r}; known formats: {', '.join(FORMATS)}"
        ) from None


def calibrated_formats() -> list[str]:
    """The formats a calibration artifact can hold codebooks for (mixed formats and K/V pairs are served from their
    parts')."""
    return [n for n, f in FORMATS.items() if f.needs_calibration and not f.mix and not f.kv]


def check_window(window, block_size: int, where: str = "temporalkv_recent_window") -> int:
    """A recent window in tokens: a multiple of BLOCK_TOKENS, >= 0, below the page size."""
    if isinstance(window, bool) or not isinstance(window, int):
        try:
            window = int(str(window).strip())
        except ValueError:
            raise FormatError(f"{where}={window!r} is not a whole number of tokens") from None
    if window < 0 or window % BLOCK_TOKENS:
        raise FormatError(f"{where}={window}: the recent window is kept in whole blocks; use a multiple of "
                          f"{BLOCK_TOKENS} (0 = none)")
    if window + BLOCK_TOKENS > block_size:
        raise FormatError(f"{where}={window}: the window and the incomplete block ({window + BLOCK_TOKENS} tokens) "
                          f"must fit in one page of {block_size}; use a larger --block-size or a smaller window")
    return window


def check_head_dim(fmt: KVFormat, head_dim: int) -> None:
    for part in fmt.mix + fmt.kv:  # a mixed format serves each layer as one of its parts, a pair K and V
        check_head_dim(get_format(part), head_dim)
    if fmt.kv:
        return
    problem = get_method(fmt.method).head_dim_problem(fmt.chunk, fmt.n_centroids, head_dim)
    if problem:
        raise FormatError(f"{fmt.name} {problem}")
