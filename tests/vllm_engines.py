"""Several vLLM engines, one after another, in this one process (a notebook, a harness sweeping formats).

    python -m tests.vllm_engines MODEL_DIR ARTIFACT FORMAT [FORMAT ...]

Used by tests/test_vllm_backend.py (in a subprocess: vLLM owns the process it runs in).  Prints one JSON line
per engine: its format, the KV pages vLLM allocated and its greedy text for a 300-token Austen prompt.
"""

import gc
import json
import os
import sys

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")  # every engine core in this process


def main(model_dir: str, artifact: str, *formats: str) -> None:
    from vllm import LLM, SamplingParams

    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.models import load_tokenizer

    ids = load_tokenizer(model_dir).encode(load_austen()["Emma"])[30_000:30_300]
    for fmt in formats:
        llm = LLM(model=model_dir, kv_cache_dtype=fmt, dtype="bfloat16", max_model_len=2048, enforce_eager=True,
                  additional_config={"temporalkv_artifact": artifact})
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)
        print("ENGINE " + json.dumps(dict(format=fmt, pages=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
                                          text=out[0].outputs[0].text)), flush=True)
        del llm, out
        gc.collect()


if __name__ == "__main__":
    main(*sys.argv[1:])
