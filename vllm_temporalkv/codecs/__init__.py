"""Reference codecs in plain torch: the truth that kernels, the vLLM backend and calibration are
tested against.  One module per method (temporal, channel, scalar = KVQuant-style) behind the ``Codec``
interface; ``quantizer`` adds what every method shares (normalization, sinks, blocks, outliers).

The seed baselines that are not codebook methods have reference codecs of their own shape, used by the
quality harness (benchmarks/quality_seeds.py): ``selective`` (seed 003, per-token symmetric int8 / int4;
served, behind ``SelectiveQuantizer``), ``tada`` (seed 004, mean across KV heads + asymmetric deviations,
per-layer bits search; served at uniform bits, behind ``TadaQuantizer``) and ``qjl`` (seed 002, 1-bit JL key
sketches + 2-bit values; served, behind ``QJLKeyQuantizer`` / ``QJLValueQuantizer``)."""

from .base import Codec, exact_sq_dist, nearest
from .channel import ChannelCodec
from .scalar import ScalarCodec
from .temporal import TemporalCodec

CODECS: dict[str, type[Codec]] = {
    "temporal": TemporalCodec,
    "channel": ChannelCodec,
    "scalar": ScalarCodec,
}


def calibration_free_quantizers(fmt, *, head_dim: int | None = None, layer: int | None = None, rope=None):
    """(K, V) serving quantizers of a format that needs no calibration artifact.  QJL's depend on the layer (its
    sketch size) and the head dim; ``rope`` (rope.Rope) lets its key quantizer's ``fake_quant`` take pre-RoPE keys."""
    if fmt.method == "selective":
        from .selective import SelectiveQuantizer

        return SelectiveQuantizer(fmt.nominal_bits), SelectiveQuantizer(fmt.nominal_bits)
    if fmt.method == "tada":
        from .tada import TadaQuantizer

        return TadaQuantizer(fmt.nominal_bits), TadaQuantizer(fmt.nominal_bits)
    if fmt.method == "qjl":
        from .qjl import QJLKeyQuantizer, QJLValueQuantizer

        if head_dim is None or layer is None:
            raise ValueError(f"{fmt.name}'s quantizers depend on the layer and the head dim: pass head_dim and layer")
        return QJLKeyQuantizer(head_dim, layer, rope), QJLValueQuantizer()
    raise ValueError(f"{fmt.name} is served from a calibration artifact (method {fmt.method!r})")


def make_codec(method: str, chunk: int, n_centroids: int, centroids=None) -> Codec:
    try:
        cls = CODECS[method]
    except KeyError:
        raise ValueError(f"unknown codec method {method!r}; known: {', '.join(CODECS)}") from None
    return cls(chunk, n_centroids, centroids)


__all__ = [
    "CODECS",
    "ChannelCodec",
    "Codec",
    "ScalarCodec",
    "TemporalCodec",
    "calibration_free_quantizers",
    "exact_sq_dist",
    "make_codec",
    "nearest",
]
