"""What the tests and the benchmarks share (not the serving path): reference semantics and process plumbing.

    simulate.py   the thesis's simulated KV compression of a format in a HuggingFace model (Simulator,
                  token_nlls, window_nll, the causal protocol's attention), the reference a server is compared with
    seeds.py      the seed configuration not served (TaDA with per-layer bits) in the same simulation
    server.py     a real `vllm serve` process: start, wait, read its KV capacity, stop (VLLMServer, free_port)
    artifacts.py  every tensor of an artifact file; random artifacts shaped for a model (speed runs)

Imports no vLLM and nothing of ``vllm_temporalkv.vllm``; nothing on the serving path imports it
(tests/test_architecture.py).
"""
