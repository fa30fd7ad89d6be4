"""A random-initialised small Llama with a small byte-level BPE tokenizer (ChatML's special tokens),
saved as a HuggingFace folder without a chat template: fine-tuning tests' base model; and LoRA
adapters that change a model's output, for tests comparing two ways of computing it."""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(folder: Path, text: str) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def tiny_llama(folder: Path, text: str = "", seed: int = 0, layers: int = 2) -> Path:
    import transformers
    from num2words import num2words
    folder.mkdir(parents=True, exist_ok=True)
    text = text or " ".join(f"Write {x} in French words. {num2words(x, lang='fr')}" for x in range(0, 3000, 7))
    vocab = tiny_tokenizer(folder, text + " user assistant system")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   eos_token_id=2, bos_token_id=0, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def with_active_lora(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with rank-4 LoRA on q, v and down whose B is not zero (a fresh adapter's B is, and
    would leave the output unchanged, so a comparison would not see the adapters): in place."""
    from tformer.training.lora import LoRASpec, add_lora

    add_lora(model, LoRASpec(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")))
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    return model
