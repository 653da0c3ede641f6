"""Randomly initialised Llama models with the shapes users run, and the data the scale benchmark edits them with.

A random model knows nothing, so what it measures is cost, not quality: seconds and memory of every stage of a real
run (`grom unlearn` end to end) at the sizes of Llama-3.2-1B and around it, from which the growth with width is
fitted. Weights are drawn from a seeded normal (Llama's `initializer_range`) straight in bfloat16, the dtype such
checkpoints ship in, and saved with `save_pretrained` (safetensors); the tokenizer is a byte-level BPE trained on
the benchmark's own texts (its ids are a small part of the 128,256-row vocabulary, which the head still computes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from grom_core.benchmarks.authors import author_questions, make_authors
from grom_core.data import Example

log = logging.getLogger(__name__)

LLAMA3_VOCAB = 128_256
TOKENIZER_VOCAB = 2048  # the BPE trained on the benchmark's texts; its ids index the first rows of the vocabulary


@dataclass(frozen=True)
class ScaleShape:
    """A Llama decoder's shape: `layers` blocks of width `hidden`, MLP width `intermediate`, `heads` query and
    `kv_heads` key/value heads, a `vocab`-row embedding, `tied` when the LM head is the embedding."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = LLAMA3_VOCAB
    tied: bool = True

    def parameters(self) -> int:
        """Parameter count (the tied head counted once)."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        block = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embedding = self.vocab * self.hidden
        return self.layers * block + embedding * (1 if self.tied else 2) + self.hidden

    def weight_bytes(self, bytes_per_value: int = 2) -> int:
        return self.parameters() * bytes_per_value

    def config(self, tokenizer=None):
        from transformers import LlamaConfig

        ids = {} if tokenizer is None else {"pad_token_id": tokenizer.pad_token_id,
                                            "bos_token_id": tokenizer.bos_token_id,
                                            "eos_token_id": tokenizer.eos_token_id}
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=2048, rope_theta=500000.0,
                           tie_word_embeddings=self.tied, dtype="bfloat16", **ids)

    def digest(self, seed: int) -> str:
        return hashlib.sha256(json.dumps({**asdict(self), "seed": seed, "tokenizer_vocab": TOKENIZER_VOCAB},
                                         sort_keys=True).encode()).hexdigest()


# Llama-3.2-1B (16 layers, 2048 wide, MLP 8192, 32/8 heads, 128,256 tied) and the same depth at other widths: the
# MLP width, which sizes the down-projections' Gram matrices and solves, is 4x the width in every one of them.
SHAPES = {
    "w512": ScaleShape("w512", 16, 512, 2048, 8, 2),
    "w1024": ScaleShape("w1024", 16, 1024, 4096, 16, 4),
    "llama-3.2-1b": ScaleShape("llama-3.2-1b", 16, 2048, 8192, 32, 8),
    "w2560": ScaleShape("w2560", 16, 2560, 10240, 40, 8),
}
# Shapes planned for, not built on a 24 GB machine: docs/scale.md extrapolates to them.
PLANNED = {
    "llama-3-8b": ScaleShape("llama-3-8b", 32, 4096, 14336, 32, 8, tied=False),
}


def get_shape(name: str) -> ScaleShape:
    from grom_core.errors import DataError

    if name not in SHAPES:
        raise DataError(f"unknown scale shape '{name}'; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def scale_data(n_forget: int = 8, n_retain: int = 64, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """`n_forget` and `n_retain` QA rows about fictitious authors, forget and retain about different authors. The
    rows name no subject: a random model knows no author better than a stranger, so the drops asked are sized by
    its own margins (GROM's default for QA rows without one), which every model has."""
    authors = make_authors(-(-(n_forget + n_retain) // 8) + 1, seed=seed)
    rows = [(a.name, ex) for a in authors for ex in author_questions(a)]
    forgotten = {name for name, _ in rows[:n_forget]}
    return ([ex for _, ex in rows[:n_forget]],
            [ex for name, ex in rows if name not in forgotten][:n_retain])


def build_scale_model(shape: ScaleShape, texts: list[str], out: str | Path, seed: int = 0) -> Path:
    """Write a random model of `shape` (bfloat16 safetensors, seeded) and its tokenizer to `out`/<digest>; reused
    when already there. Returns the folder."""
    from transformers import LlamaForCausalLM

    from grom_core.finetune import train_tokenizer

    folder = Path(out) / f"{shape.name}-{shape.digest(seed)[:12]}"
    if (folder / "config.json").is_file():
        return folder
    tokenizer = train_tokenizer(texts, TOKENIZER_VOCAB)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # drawn in the dtype it is saved in: no float32 copy of 1B weights
    try:
        model = LlamaForCausalLM(shape.config(tokenizer))
    finally:
        torch.set_default_dtype(previous)
    tmp = folder.with_name(folder.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    log.info("scale model %s: %.2fB parameters, %.1f GB bfloat16, in %s", shape.name, shape.parameters() / 1e9,
             shape.weight_bytes() / 1e9, folder)
    return folder
