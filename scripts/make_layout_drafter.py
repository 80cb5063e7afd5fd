"""Write a random-weight drafter laid out as the released D3D drafters are (Qwen3, sharded safetensors), for
memory and time measurements of the tool on real sizes without downloading one.

    python scripts/make_layout_drafter.py OUT --layers 36 --hidden 512 --dtype bfloat16 --max-shard-size 80MB

The layout follows the dense Qwen3 models (Qwen3-1.7B: hidden 2048, Qwen3-8B: hidden 4096): intermediate size
3 x hidden, heads of width 128, hidden / 128 query heads and 8 key/value heads (fewer when there are fewer
query heads), vocabulary 151,936; embeddings tied unless --untied (Qwen3-8B unties them). The drafter keys
are block_size 16 and a mask id past the tokenizer's real tokens. The tokenizer files come from --tokenizer
(default: the demo target when it is cached, else the demo drafter, which carries the same files), so the
drafter pairs with the demo target: only its first len(tokenizer) ids are proposable (draft_vocab_size).
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_HEAD_DIM, QWEN3_KV_HEADS, QWEN3_MLP_RATIO = 128, 8, 3
QWEN3_VOCAB, QWEN3_TOKENS = 151936, 151669  # ids past QWEN3_TOKENS are padding rows of Qwen3's embedding


def default_tokenizer() -> Path:
    from models.demo import demo_drafter_dir, demo_target_dir

    target = demo_target_dir()
    return target if (target / "tokenizer.json").is_file() else demo_drafter_dir()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", help="new drafter folder")
    parser.add_argument("--layers", type=int, default=36, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=512, help="model width (a multiple of 128)")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB, help="embedding rows")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="dtype of the stored weights")
    parser.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 80MB")
    parser.add_argument("--block-size", type=int, default=16, help="the drafter's block_size")
    parser.add_argument("--untied", action="store_true", help="an lm_head of its own (as Qwen3-8B)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder whose tokenizer files are copied (default: the demo target if cached, else "
                        "the demo drafter); 'none' for no tokenizer (mask id 151669, Qwen3's first unused id)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from models.checkpoint import copy_tokenizer_files
    from models.drafter import create_drafter, save_drafter

    if args.hidden % QWEN3_HEAD_DIM:
        parser.error(f"--hidden {args.hidden} is not a multiple of the head width {QWEN3_HEAD_DIM}")
    tokenizer_dir = None if str(args.tokenizer) == "none" else args.tokenizer or default_tokenizer()
    tokens = len(AutoTokenizer.from_pretrained(str(tokenizer_dir))) if tokenizer_dir else QWEN3_TOKENS
    if tokens >= args.vocab:
        parser.error(f"--vocab {args.vocab} leaves no id for the mask token past the tokenizer's {tokens} tokens")
    heads = args.hidden // QWEN3_HEAD_DIM
    model = create_drafter(
        vocab_size=args.vocab, mask_token_id=tokens, draft_vocab_size=tokens, block_size=args.block_size,
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=QWEN3_MLP_RATIO * args.hidden,
        num_attention_heads=heads, num_key_value_heads=math.gcd(heads, QWEN3_KV_HEADS), head_dim=QWEN3_HEAD_DIM,
        seed=args.seed, tie_word_embeddings=not args.untied, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ).to(getattr(torch, args.dtype))  # in place, tensor by tensor: one copy of the weights at a time
    # Only the tokenizer files: a random drafter was trained on nothing (no record of training prompts).
    folder = save_drafter(model, args.out, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
                          before_commit=lambda tmp: tokenizer_dir and copy_tokenizer_files(tokenizer_dir, tmp))
    params = sum(p.numel() for p in model.parameters())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    print(f"{folder}: {args.layers} layers, hidden {args.hidden}, {heads} heads ({model.config.num_key_value_heads} "
          f"kv), intermediate {model.config.intermediate_size}, vocab {args.vocab}, {params / 1e9:.3f} B parameters "
          f"in {args.dtype}, mask id {tokens}, {len(files)} weight file{'s' * (len(files) != 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
