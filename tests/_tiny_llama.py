"""The 4-layer Hugging Face Llama the pipeline tests train: vocabulary 32, width 32, 4 heads over 2
KV heads (TP 2 splits both), eager attention."""

from __future__ import annotations

import torch

VOCAB = 32


def tiny_llama(*, tied: bool = False, meta: bool = False):
    """A LlamaForCausalLM of that size (input and output embeddings tied or not), on meta if asked."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    if meta:
        with torch.device("meta"):
            return tf.LlamaForCausalLM(config)
    return tf.LlamaForCausalLM(config)
