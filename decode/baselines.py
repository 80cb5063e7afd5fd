"""Baselines a user would try first: transformers' own `generate()` on the target, greedy.

- `generate`: plain greedy `target.generate()`, the reference that shows our `ar` decoder is a fair
  baseline (it should be no slower).
- `pld`: prompt-lookup decoding (`prompt_lookup_num_tokens`): drafts by copying n-grams from the prompt,
  no drafter at all.
- `assisted`: assisted generation (`assistant_model`): a small autoregressive model of the target's
  tokenizer drafts, the target verifies (needs `BaselineConfig.assistant_model`).

Each returns a `DecodeResult` like our decoders, so the bench summarizes, compares and times them alike.
Timing follows the decoders' convention, time per token excluding prefill and the first token:
`generate()` cannot be timed from inside, so a `generate(max_new_tokens=1)` call on the same prompt with
the same options just before stands for prefill (plus the call's setup, which both calls pay), and
`decode_s = T(full) - T(that call)`, clamped at 0. There are no rounds (tau is null). The output is
trimmed by our stop rule (it ends at and includes the first stop id, `max_new_tokens` at most), so greedy
outputs compare exactly with `ar`. Greedy only: there is no sampled counterpart of our verification rule.

Extension point: a baseline is an entry of decode.registry (kind BASELINE) naming its function here,
function(target, prompt ids, DecodeConfig, BaselineConfig) -> DecodeResult.
"""

import time

import torch

from models.errors import ConfigError

from .config import BaselineConfig, DecodeConfig
from .decoders import DecodeResult
from .registry import ASSISTED


def decode_generate(target, prompt: list[int], config: DecodeConfig, options: BaselineConfig) -> DecodeResult:
    """transformers' plain greedy generate()."""
    return _timed_generate("generate", target, prompt, config)


def decode_pld(target, prompt: list[int], config: DecodeConfig, options: BaselineConfig) -> DecodeResult:
    """transformers' prompt-lookup decoding."""
    return _timed_generate("pld", target, prompt, config, prompt_lookup_num_tokens=options.pld_tokens)


def decode_assisted(target, prompt: list[int], config: DecodeConfig, options: BaselineConfig) -> DecodeResult:
    """transformers' assisted generation with `options.assistant_model` as the draft model."""
    if options.assistant_model is None:
        raise ConfigError("the assisted decoder needs a draft model; pass --assistant MODEL (a small causal LM "
                          "folder or .gguf file with the target's tokenizer)")
    return _timed_generate(ASSISTED, target, prompt, config, assistant_model=options.assistant_model)


def _timed_generate(name: str, target, prompt: list[int], config: DecodeConfig, **options) -> DecodeResult:
    """Greedy `target.generate(**options)` on one prompt, timed as prefill + decode (see the module docstring)."""
    device = next(target.parameters()).device
    input_ids = torch.tensor([prompt], device=device)
    stops = list(config.stop_ids)
    pad = target.generation_config.pad_token_id
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),  # one unpadded row; generate() warns without it
        do_sample=False,
        num_beams=1,
        eos_token_id=stops or None,  # None: no stop ids, like our stop rule (not the model's own EOS)
        pad_token_id=pad if pad is not None else (stops[0] if stops else 0),
        **options,
    )

    def run(max_new_tokens: int) -> tuple[list[int], float]:
        start = time.perf_counter()
        with torch.inference_mode():  # as our verifiers run the target
            sequence = target.generate(max_new_tokens=max_new_tokens, **kwargs)
        generated = sequence[0, len(prompt) :].tolist()  # .tolist() waits for the device
        return generated, time.perf_counter() - start

    _, prefill_s = run(1)
    generated, total_s = run(config.max_new_tokens)
    output, _ = config.stop_rule.truncate(generated, 0)
    return DecodeResult(name, len(prompt), output, prefill_s=prefill_s, decode_s=max(0.0, total_s - prefill_s))
