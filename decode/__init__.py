"""Decoding: verifiers (live, replay), the ar / sync / async decoders, metrics, prompts, benchmarks.

Importing this package is cheap; torch and transformers load with the submodules that need them.
"""
