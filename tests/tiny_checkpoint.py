"""A checkpoint directory as a new user has one, made in a second with no transformers: the built-in ``tiny``
model's weights and config.json, and a byte-level BPE tokenizer.json trained here by the ``tokenizers``
package to the model's 512 ids."""

from __future__ import annotations

import json
import random
from pathlib import Path

from safetensors.torch import save_file

from pagedmla.model import load_model
from pagedmla.model.config import TINY_CONFIG

# Words of random letters: enough distinct pairs for the BPE trainer to reach the vocabulary size.
_WORDS = ["".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=2 + i % 6)) for i in range(400)]
SPECIAL = ["<s>", "</s>"]


def train_tokenizer(path: Path, vocab_size: int = TINY_CONFIG["vocab_size"]) -> Path:
    """Write a byte-level BPE tokenizer.json of ``vocab_size`` ids (``<s>`` = 0, ``</s>`` = 1) to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.choices(_WORDS, k=50)) for _ in range(200)] + ["Hello world"], trainer)
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(path))
    return path


def write_checkpoint(directory: Path, tokenizer: bool = True) -> Path:
    """The tiny model (seed 0) as model.safetensors + config.json in ``directory``, with tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    model = load_model("tiny")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    if tokenizer:
        train_tokenizer(directory / "tokenizer.json")
    return directory
