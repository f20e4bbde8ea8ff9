"""Tiny, randomly initialised Hugging Face models that vLLM's CPU build serves, saved locally.

No hub access: each model is a transformers config with random weights (seeded) and a
word-level tokenizer of its own, kept in a folder apart from the model (with a config of a
known ``model_type`` beside it, ``AutoTokenizer`` would build that model's own pipeline and
ignore ``tokenizer.json``); pass it to vLLM as ``tokenizer=``.

The CPU attention backend takes head sizes 32, 64, 80, ... (not 16) and blocks of a multiple
of 32 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Words of the tokenizer's vocabulary; prompts are made of them.
WORDS = [f"w{i}" for i in range(500)]
VOCAB = 512  # the model's vocabulary: the words, [UNK], [BOS], [EOS], padding to 512


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2}
    for word in WORDS:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )
    fast.save_pretrained(folder)


#: What both models share: GQA, 4 query heads over 2 KV heads of 64, so TP 2 holds one KV
#: head per rank.
_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=10000.0,
)
#: name -> (transformers config class, model class, config keywords).
MODELS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_SHAPE, num_hidden_layers=4, tie_word_embeddings=False),
    ),
    # q/k norms, tied embeddings
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_SHAPE, num_hidden_layers=3, tie_word_embeddings=True),
    ),
}


def make(root: Path, name: str) -> tuple[Path, Path]:
    """Saves model ``name`` under ``root`` (once); returns (model folder, tokenizer folder)."""
    import torch
    import transformers

    model_dir, tok_dir = root / name, root / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        _tokenizer(tok_dir)
    if (model_dir / "config.json").exists():
        return model_dir, tok_dir
    config_cls, model_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, dtype="float32", **kwargs
    )
    torch.manual_seed(20261203)
    model = getattr(transformers, model_cls)(config)
    # Random weights of this size give near-uniform logits; a wider spread keeps greedy
    # decoding away from ties, so a wrong cache shows as different tokens.
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0)
    model.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "kvferry-e2e.json").write_text(json.dumps({"model": name, **kwargs}))
    return model_dir, tok_dir


if __name__ == "__main__":
    import sys

    for name in sys.argv[2:] or list(MODELS):
        print(*make(Path(sys.argv[1]), name))
