"""Named tiny random-weight models for tests: `tiny` (target) and `tiny-draft` (its drafter).

Both are LlamaForCausalLM, the architecture family of SmolLM2, with 2 layers and hidden size 64.
The tokenizer is a real fast (Hugging Face `tokenizers`) byte-level tokenizer: id 0 is
`<|endoftext|>` and ids 1..256 are the 256 byte symbols, no merges, so any text round-trips.
Weights are drawn from a seeded generator, independent of torch's global random state.
`tiny-draft` is `tiny` with every weight perturbed by a small seeded noise, so that it agrees
with the target on most but not all greedy tokens (partial acceptance in tests).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_SEED = 20261101
TINY_DRAFT_NOISE_SEED = 20261102
TINY_DRAFT_NOISE = 0.1
END_OF_TEXT = "<|endoftext|>"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {END_OF_TEXT: 0} | {symbol: index + 1 for index, symbol in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT, pad_token=END_OF_TEXT
    )


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def tiny_model(*, draft: bool = False) -> LlamaForCausalLM:
    # fork_rng: building the module runs torch's default initialisers on the global generator;
    # every parameter is then overwritten from our own seeded generator.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(tiny_config())
    generator = torch.Generator().manual_seed(TINY_SEED)
    noise = torch.Generator().manual_seed(TINY_DRAFT_NOISE_SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if parameter.dim() == 1:
                parameter.fill_(1.0)  # RMSNorm gains
                continue
            # Unit-variance embeddings give peaked next-token distributions; 1/sqrt(fan_in)
            # keeps activations of the projections at unit scale.
            scale = 1.0 if "embed_tokens" in name else parameter.shape[1] ** -0.5
            values = torch.randn(parameter.shape, generator=generator) * scale
            if draft:
                values += torch.randn(parameter.shape, generator=noise) * scale * TINY_DRAFT_NOISE
            parameter.copy_(values)
    model.eval()
    return model
