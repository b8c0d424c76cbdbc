"""The mixed-format policy: which of its parts serves each layer of a mixed format (``KVFormat.mix``).

TaDA's per-layer search (seed 004, ``codecs.tada.search_layer_bits``) applied to TemporalKV's chunk lengths: each
layer gets the part whose bits buy the least estimated loss increase under the mix's average bits, from the
calibration's diagonal-Fisher estimate of each layer's K + V loss increase at its hybrid choice (the artifact's
``hybrid.<part>.cost``).  Deterministic: every process (every tensor-parallel rank, every restart) computes the
same choice.  The artifact (artifact.py) holds the costs and asks this module; nothing here reads a file.
"""

from __future__ import annotations

from typing import Callable, Mapping

from .codecs.tada import search_layer_bits
from .formats import KVFormat, get_format

KV = ("k", "v")


class MissingCosts(ValueError):
    """The calibration has no per-layer loss estimates for these parts (an artifact written before they were)."""

    def __init__(self, parts: list[str]):
        super().__init__(", ".join(parts))
        self.parts = parts


def choose_layer_formats(fmt: KVFormat, num_layers: int, cost: Mapping, method_of: Callable[[KVFormat, int, str], str]
                         ) -> list[str]:
    """The part serving each layer.  ``cost[part][layer]``: [K/V, temporal/channel] estimated loss increases
    (nats per token); ``method_of(part format, layer, kind)``: the hybrid's chunking of that layer ("temporal" or
    "channel")."""
    missing = [p for p in fmt.mix if p not in cost]
    if missing:
        raise MissingCosts(missing)
    bits = {get_format(p).nominal_bits: p for p in fmt.mix}
    per_layer = {}
    for layer in range(num_layers):
        per_layer[layer] = {}
        for b, p in bits.items():
            c = cost[p][layer]  # [K/V, temporal/channel]
            per_layer[layer][b] = float(sum(c[j, int(method_of(get_format(p), layer, kv) == "channel")]
                                            for j, kv in enumerate(KV)))
    choice = search_layer_bits(per_layer, fmt.nominal_bits)
    return [bits[choice[layer]] for layer in range(num_layers)]
