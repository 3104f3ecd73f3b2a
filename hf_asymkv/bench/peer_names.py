"""The names of the peers' emulated cache formats, torch-free: the command line lists and checks them without
importing torch; :data:`hf_asymkv.bench.peers.PEERS` defines one format under each and refuses any other name.
A module of its own so that :mod:`~hf_asymkv.bench.schemes` (which builds them lazily through
:mod:`~hf_asymkv.bench.peers`) and :mod:`~hf_asymkv.bench.peers` both read it without importing each other."""

from __future__ import annotations

__all__ = ["PEER_SCHEMES"]

PEER_SCHEMES = {
    "vllm-int8-pth": "vLLM int8_per_token_head",
    "vllm-int4-pth": "vLLM int4_per_token_head (randomized Hadamard)",
    "vllm-tq-k8v4": "vLLM turboquant_k8v4",
    "vllm-fp8-tensor": "vLLM fp8_e4m3, per-tensor scales from the first forward",
    "llama-q8_0": "llama.cpp q8_0 cache",
    "llama-q4_0": "llama.cpp q4_0 cache",
    "llama-q8_0-rot": "llama.cpp q8_0 cache with the Hadamard rotation",
    "llama-q4_0-rot": "llama.cpp q4_0 cache with the Hadamard rotation",
    "kivi-2": "KIVI-2 (2-bit, K per channel / V per token, groups of 32, window 128)",
    "kivi-4": "KIVI-4",
}
