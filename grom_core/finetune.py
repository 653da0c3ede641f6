"""Local training of small causal LMs: a byte-level BPE tokenizer trained on the data, a tiny Llama built from
scratch, and a seeded supervised fine-tuning loop. Nothing is downloaded.

This is how the project makes the target models ("trained on everything") and retain models ("trained without the
forget set") it measures unlearning on, and how tests get a real model that has memorised something.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grom_core.data import Example, PromptFormat, make_batches, prompt_format
from grom_core.fingerprint import data_digest
from grom_core.gradient.methods import FROM_SCRATCH_FLAG
from grom_core.progress import progress_bar

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a tiny Llama. Sizes are counts (units: dimensions, layers, heads, tokens)."""

    vocab_size: int = 600
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    max_length: int = 256


@dataclass(frozen=True)
class TrainConfig:
    """Supervised fine-tuning knobs. lr in AdamW units; epochs over the whole data."""

    epochs: int = 40
    lr: float = 3e-3
    batch_size: int = 16
    weight_decay: float = 0.0
    warmup_steps: int = 10
    seed: int = 0


def example_texts(examples: Sequence[Example]) -> list[str]:
    """The raw strings a tokenizer should be trained on."""
    out = []
    for ex in examples:
        out.append(ex.text if ex.text is not None else f"Question: {ex.question}\nAnswer: {ex.answer}")
    return out


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` (deterministic for the same texts and size)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def build_tiny_llama(tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    llama = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads, max_position_embeddings=config.max_length,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    setattr(llama, FROM_SCRATCH_FLAG, True)  # saved in config.json: gradient methods pick this kind's recipe
    return LlamaForCausalLM(llama)


def finetune(model: torch.nn.Module, tokenizer, examples: Sequence[Example], config: TrainConfig,
             max_length: int = 256, fmt: str | PromptFormat = "qa") -> list[float]:
    """Train `model` in place on `examples` (answer tokens only for QA pairs, in prompt format `fmt`) with AdamW;
    returns the mean loss per epoch. A progress bar runs over the steps; each epoch ends with a log line."""
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    order = list(range(len(examples)))
    steps_per_epoch = -(-len(examples) // config.batch_size)
    total = steps_per_epoch * config.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def lr_at(step: int) -> float:  # linear warm-up, then linear decay to 10%
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        return max(0.1, 1 - 0.9 * (step - config.warmup_steps) / max(1, total - config.warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    device = next(model.parameters()).device
    losses = []
    with progress_bar(total, "finetune") as advance:
        for epoch in range(config.epochs):
            rng.shuffle(order)
            batches = make_batches(tokenizer, [examples[i] for i in order], config.batch_size, max_length, fmt=fmt)
            epoch_loss = 0.0
            for batch in batches:
                batch = batch.to(device)
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                epoch_loss += out.loss.item()
                advance(description=f"finetune epoch {epoch + 1}/{config.epochs}")
            losses.append(epoch_loss / len(batches))
            if (epoch + 1) % max(1, config.epochs // 10) == 0 or epoch + 1 == config.epochs:
                log.info("finetune: epoch %d/%d, loss %.4f", epoch + 1, config.epochs, losses[-1])
    model.eval()
    return losses


def training_digest(examples: Sequence[Example], model_config: TinyModelConfig, train_config: TrainConfig,
                    tokenizer_texts: Sequence[str] | None = None) -> str:
    """Digest of everything that determines a trained model: data, both configs, tokenizer texts, torch version."""
    records = [{"model": asdict(model_config), "train": asdict(train_config), "torch": torch.__version__,
                "tokenizer_texts": data_digest(tokenizer_texts) if tokenizer_texts is not None else None}]
    return data_digest(records + [ex.record() for ex in examples])[:16]


def train_model(examples: Sequence[Example], out: str | Path, *, base: str | Path | None = None,
                model_config: TinyModelConfig = TinyModelConfig(), train_config: TrainConfig = TrainConfig(),
                tokenizer_texts: Sequence[str] | None = None, fmt: str | PromptFormat = "qa") -> Path:
    """Train a causal LM on `examples` (QA pairs in prompt format `fmt`) and save it (safetensors) with its
    tokenizer into `out`.

    Without `base`: a tiny Llama from scratch with a byte-level BPE tokenizer trained on the data (or on
    `tokenizer_texts`). With `base`: full fine-tuning of the local checkpoint in that directory, in float32
    (model_config unused). The directory is written under a temporary name and renamed at the end, so a crash
    never leaves a half model.
    """
    from grom_core.loading import load_model

    out = Path(out)
    if base is not None:
        model, tokenizer = load_model(base, dtype=torch.float32)
        max_length = getattr(model.config, "max_position_embeddings", model_config.max_length)
    else:
        tokenizer = train_tokenizer(tokenizer_texts or example_texts(examples), model_config.vocab_size)
        model = build_tiny_llama(tokenizer, model_config, seed=train_config.seed)
        max_length = model_config.max_length
    log.info("training %s (%d parameters) on %d examples", "from " + str(base) if base else "a tiny Llama",
             sum(p.numel() for p in model.parameters()), len(examples))
    losses = finetune(model, tokenizer, examples, train_config, max_length=max_length, fmt=fmt)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "training.json").write_text(json.dumps({
        "model": asdict(model_config) if base is None else {"base": str(base)}, "train": asdict(train_config),
        "prompt_format": prompt_format(fmt).name, "final_loss": losses[-1], "losses": losses,
        "examples": len(examples)}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def train_tiny_model(examples: Sequence[Example], cache_dir: str | Path, *,
                     model_config: TinyModelConfig = TinyModelConfig(), train_config: TrainConfig = TrainConfig(),
                     tokenizer_texts: Sequence[str] | None = None) -> Path:
    """Train (or reuse) a tiny Llama on `examples`; returns its directory (`save_pretrained`, safetensors).

    Cached under `cache_dir/tiny-<digest>` where the digest covers the data, both configs, the tokenizer texts and
    the torch version, so a change of any of them trains a new model. A finished model is marked by `training.json`.
    """
    out = Path(cache_dir) / f"tiny-{training_digest(examples, model_config, train_config, tokenizer_texts)}"
    if (out / "training.json").exists():
        log.info("reusing the trained model in %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return train_model(examples, out, model_config=model_config, train_config=train_config,
                       tokenizer_texts=tokenizer_texts)


def finetune_pretrained(examples: Sequence[Example], base: str | Path, cache_dir: str | Path, *,
                        train_config: TrainConfig, fmt: str | PromptFormat = "qa") -> Path:
    """Full fine-tuning of the pretrained model in `base` on `examples` (or reuse of an earlier one); returns the
    model's directory, `cache_dir/<base folder>-ft-<digest>`.

    The digest covers the data, the training configuration, the prompt format, the torch version and the base
    folder's name (the shipped models' folders are named by their content's sha256), so a change of any of them
    trains anew. A finished model is marked by `training.json`.
    """
    base = Path(base)
    record = {"base": base.name, "train": asdict(train_config), "format": prompt_format(fmt).name,
              "torch": torch.__version__}
    digest = data_digest([record] + [ex.record() for ex in examples])[:16]
    out = Path(cache_dir) / f"{base.name}-ft-{digest}"
    if (out / "training.json").exists():
        log.info("reusing the fine-tuned model in %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return train_model(examples, out, base=base, train_config=train_config, fmt=fmt)
