"""Collect pre-RoPE K and V and the gradients of the LM loss with respect to them.

One forward + backward per calibration window; hooks on the pre-RoPE K / V projections keep the
activations and register tensor hooks for their gradients (the diagonal Fisher information,
thesis sec. 5.2.1).  The first SINK_TOKENS tokens of every window are dropped: their Fisher
weights are orders of magnitude larger and they are never quantized anyway (sec. 5.4).
"""

from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm

from ..formats import SINK_TOKENS
from ..hf_hooks import check_supported, head_shape, kv_output_hooks

LOSS_CHUNK = 256  # low-memory collection: tokens whose logits exist at once


@contextlib.contextmanager
def checkpointed_layers(model: torch.nn.Module):
    """Each decoder layer's forward under torch's (non-reentrant) activation checkpointing: the backward keeps
    one layer's activations at a time and recomputes them from the layer's input.  The recomputation runs the
    same operations on the same input: the K / V hooks see the same values again (and their gradient hooks are
    registered on tensors that take no part in the backward)."""
    from torch.utils.checkpoint import checkpoint

    layers = list(model.model.layers)
    for layer in layers:
        layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def _lm_loss_backward(model: torch.nn.Module, emb: torch.Tensor, ids: torch.Tensor, low_memory: bool) -> None:
    """Backward of the summed next-token loss of one window.  ``low_memory``: the decoder layers checkpointed and
    the logits made LOSS_CHUNK tokens at a time (for a 150k vocabulary 2048 tokens of float32 logits, their
    log-softmax and gradients are ~5 GB); the same loss, gradients equal up to float rounding."""
    if not low_memory:
        logits = model(inputs_embeds=emb).logits.float()
        # summed (not averaged) token losses keep the squared gradients well above underflow
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        loss.backward()
        return
    check_supported(model.config)  # a plain decoder: logits = lm_head(final hidden states), nothing after
    with checkpointed_layers(model):
        hidden = model.model(inputs_embeds=emb, use_cache=False).last_hidden_state  # no cache: layers run twice
    h = hidden.detach().requires_grad_(True)
    head = model.get_output_embeddings()
    T = ids.shape[1]
    for a in range(0, T - 1, LOSS_CHUNK):
        b = min(a + LOSS_CHUNK, T - 1)
        logits = head(h[0, a:b]).float()
        torch.nn.functional.cross_entropy(logits, ids[0, a + 1 : b + 1], reduction="sum").backward()
        del logits
    hidden.backward(h.grad)


def collect_kv_grads(
    model: torch.nn.Module, windows: torch.Tensor, *, device: str = "cpu", progress: bool = True,
    low_memory: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """windows [S, T] token ids -> (acts, grads): per layer {"k": [S*(T-8), H, D], "v": ...}
    float32 on the CPU.  ``low_memory``: see ``_lm_loss_backward``."""
    S, T = windows.shape
    n = T - SINK_TOKENS
    H, D = head_shape(model)
    L = model.config.num_hidden_layers
    acts = [{kv: torch.empty(S * n, H, D) for kv in "kv"} for _ in range(L)]
    grads = [{kv: torch.empty(S * n, H, D) for kv in "kv"} for _ in range(L)]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    for s in tqdm(range(S), desc="collect K/V + Fisher", unit="window", disable=not progress):
        rows = slice(s * n, (s + 1) * n)

        def hook(layer: int, kind: str, out: torch.Tensor):
            acts[layer][kind][rows] = out[0, SINK_TOKENS:].detach().float().cpu()
            if out.requires_grad:
                shape = out.shape

                # the hook must not refer to ``out``: out -> its hooks -> save_grad -> out is a reference cycle
                # that keeps every window's K / V (and, through the closure, its buffers) until a gc pass
                def save_grad(g, layer=layer, kind=kind, shape=shape):
                    grads[layer][kind][rows] = g.reshape(shape)[0, SINK_TOKENS:].float().cpu()

                out.register_hook(save_grad)
            return out  # the hooked view must be what flows on, or its grad hook never fires

        ids = windows[s : s + 1].to(device)
        with kv_output_hooks(model, hook), torch.enable_grad():
            # inputs need no grad, but K/V must: make the embedding output require grad
            emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            _lm_loss_backward(model, emb, ids, low_memory)
    return acts, grads


def save_collected(path, acts: list[dict[str, torch.Tensor]], grads: list[dict[str, torch.Tensor]]) -> None:
    """Keep what ``collect_kv_grads`` returned (safetensors, written under a temporary name first)."""
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(path)
    flat = {f"{t}.{i}.{kv}": d[i][kv] for t, d in (("a", acts), ("g", grads)) for i in range(len(acts)) for kv in "kv"}
    tmp = path.with_name(path.name + ".tmp")
    save_file(flat, str(tmp))
    tmp.rename(path)


def load_collected(path) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Inverse of ``save_collected``: (acts, grads), per layer {"k": ..., "v": ...}."""
    from safetensors.torch import load_file

    flat = load_file(str(path))
    L = len({k.split(".")[1] for k in flat})
    return ([{kv: flat[f"a.{i}.{kv}"] for kv in "kv"} for i in range(L)],
            [{kv: flat[f"g.{i}.{kv}"] for kv in "kv"} for i in range(L)])


class CollectedStore:
    """Collected K / V and gradients streamed to disk a few windows at a time, read back one layer at a time.

    Holding every layer of 64 x 2048 windows in memory takes ~12 GB of float32 for SmolLM2 alone (and twice that
    while it is written); here the collection holds ``chunk`` windows and the fit one layer's tensors (~0.4 GB at
    64 windows).  Each chunk is its own safetensors file (``collected.<first window>.safetensors``), so a stopped
    collection resumes at the first missing chunk."""

    def __init__(self, folder, num_windows: int, chunk: int = 4):
        from pathlib import Path

        self.folder, self.num_windows, self.chunk = Path(folder), num_windows, chunk
        self.starts = list(range(0, num_windows, chunk))

    def path(self, start: int):
        return self.folder / f"collected.{start:05d}.safetensors"

    def missing(self) -> list[int]:
        return [s for s in self.starts if not self.path(s).is_file()]

    def collect(self, model: torch.nn.Module, windows: torch.Tensor, *, device: str = "cpu",
                progress: bool = True, low_memory: bool = False) -> None:
        todo = self.missing()
        for start in tqdm(todo, desc=f"collect K/V + Fisher ({self.chunk} windows a file)", unit="file",
                          disable=not progress or not todo):
            acts, grads = collect_kv_grads(model, windows[start : start + self.chunk], device=device, progress=False,
                                           low_memory=low_memory)
            save_collected(self.path(start), acts, grads)
            del acts, grads

    def layer(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(acts, grads) of layer ``i`` over every window, in window order: {"k": [S*(T-8), H, D], "v": ...}."""
        from safetensors import safe_open

        if self.missing():
            raise FileNotFoundError(f"collection incomplete in {self.folder}: windows from {self.missing()[0]} missing")
        parts = {f"{t}.{kv}": [] for t in "ag" for kv in "kv"}
        for start in self.starts:
            with safe_open(str(self.path(start)), "pt") as f:
                for t in "ag":
                    for kv in "kv":
                        parts[f"{t}.{kv}"].append(f.get_tensor(f"{t}.{i}.{kv}"))
        cat = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}
        return {kv: cat[f"a.{kv}"] for kv in "kv"}, {kv: cat[f"g.{kv}"] for kv in "kv"}
