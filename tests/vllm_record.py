"""Run one request through vLLM in this process and record what the TemporalKV backend saw and wrote.

    python -m tests.vllm_record MODEL_DIR FORMAT ARTIFACT OUT.safetensors

Used by tests/test_vllm_backend.py (in a subprocess: vLLM owns the process it runs in). For every
attention layer it saves the positions, query, key (post-RoPE, as vLLM passes it), value and output
of every forward call, concatenated in call order, and the layer's KV page after the request (one
1024-token page: small pages off).
The prompt (300 tokens of Emma) is prefilled in chunks of 100 tokens, so block boundaries fall
inside chunks, then 24 tokens are decoded.
"""

import os
import sys

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine core runs here, where the hook is

PROMPT = slice(20_000, 20_300)
MAX_TOKENS = 24
CHUNK = 100


def main(model_dir: str, fmt: str, artifact: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.models import load_tokenizer
    from vllm_temporalkv.vllm import backend, compat

    calls: dict[str, list[dict]] = {}
    caches: dict[str, tuple[torch.Tensor, int]] = {}
    forward = backend.TemporalKVImpl.forward

    def recording_forward(self, layer, query, key, value, kv_cache, m, output, *a, **kw):
        r = forward(self, layer, query, key, value, kv_cache, m, output, *a, **kw)
        if m is not None:
            n = m.num_actual_tokens
            calls.setdefault(layer.layer_name, []).append(
                dict(pos=m.positions[:n].clone(), q=query[:n].clone(), k=key[:n].clone(), v=value[:n].clone(),
                     o=output[:n].clone()))
            caches[layer.layer_name] = (kv_cache, int(m.page_ids[0]))
        return r

    backend.TemporalKVImpl.forward = recording_forward
    ids = load_tokenizer(model_dir).encode(load_austen()["Emma"])[PROMPT]
    llm = LLM(model=model_dir, kv_cache_dtype=fmt, dtype="bfloat16", max_model_len=2048, enforce_eager=True,
              max_num_batched_tokens=CHUNK, enable_prefix_caching=False,
              # the 1024-token pages that carry their own sinks and tail: the request's one page holds all of it
              # (the CPU's default small pages keep the same codes in 64-token pages: test_small_pages)
              additional_config={"temporalkv_artifact": artifact, "temporalkv_small_pages": False})
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                 use_tqdm=False)
    tensors = {}
    for name, cs in calls.items():
        for key in ("pos", "q", "k", "v", "o"):
            tensors[f"{name}.{key}"] = torch.cat([c[key] for c in cs])
        kv_cache, page = caches[name]
        tensors[f"{name}.page"] = compat.pages_view(kv_cache)[page].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
