"""The torch side of the Hugging Face tests, run as its own process: `python hf_reference.py OUT`.

Builds tiny random BERT/ViT/GPT-2/Llama/Qwen2/Mistral models with transformers (torch CPU), saves each to OUT/<case>/ with
save_pretrained, and writes the reference outputs on fixed inputs to OUT/<case>/reference.npz. The
tests then import the checkpoints with favor and compare, in processes that never load torch: torch
and jaxlib in one process was the suspect of the suite's native crashes (each ships its own OpenMP
and allocator hooks), and importing torch cost every pytest worker seconds and memory.

This file imports no favor and no JAX; the inputs it runs are made by `inputs()`, which the tests
import too (numpy only).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

BERT = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, type_vocab_size=2)
VIT = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=48)
GLUE_BERT = dict(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=32, num_labels=2)
GPT2 = dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=40)
# grouped-query attention (2 key/value heads for 4 query heads) and a rotary base other than the default
LLAMA = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0)
# Llama 3.1's rescaled rotary frequencies, its original window (16) shorter than the long inputs (40), and
# a linear rescaling
LLAMA3 = dict(LLAMA, rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=16))
LLAMA_LINEAR = dict(LLAMA, rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0))
# Qwen2: biases on q/k/v (grouped), rotary base 10^6, tied (as its small sizes) or untied embeddings
QWEN2 = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True)
# Mistral without a sliding window (v0.2 and later), grouped-query attention
MISTRAL = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=None)
# case -> (architecture, config, seed)
CASES = {
    "BertModel": ("BertModel", dict(BERT, num_labels=3), 0),
    "BertForMaskedLM": ("BertForMaskedLM", dict(BERT, num_labels=3), 0),
    "BertForSequenceClassification": ("BertForSequenceClassification", dict(BERT, num_labels=3), 0),
    "stsb": ("BertForSequenceClassification", dict(BERT, num_labels=1), 1),
    "ViTModel": ("ViTModel", dict(VIT, num_labels=5), 0),
    "ViTForImageClassification": ("ViTForImageClassification", dict(VIT, num_labels=5), 0),
    "glue": ("BertForSequenceClassification", GLUE_BERT, 0),
    "GPT2LMHeadModel": ("GPT2LMHeadModel", GPT2, 0),
    "LlamaForCausalLM": ("LlamaForCausalLM", LLAMA, 0),
    "llama3": ("LlamaForCausalLM", LLAMA3, 1),
    "llama-linear": ("LlamaForCausalLM", LLAMA_LINEAR, 2),
    "Qwen2ForCausalLM": ("Qwen2ForCausalLM", QWEN2, 0),
    "qwen2-untied": ("Qwen2ForCausalLM", dict(QWEN2, tie_word_embeddings=False), 1),
    "MistralForCausalLM": ("MistralForCausalLM", MISTRAL, 0),
}
CONFIGS = {"ViT": "ViTConfig", "Bert": "BertConfig", "GPT2": "GPT2Config", "Llama": "LlamaConfig",
           "Qwen2": "Qwen2Config", "Mistral": "MistralConfig"}
DECODERS = ("GPT2", "Llama", "Qwen2", "Mistral")


def inputs():
    """(ids, token types, attention mask) for BERT [3, 14] (two rows padded) and images [2, 16, 16, 3]."""
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 101, (3, 14))
    types = rng.randint(0, 2, (3, 14))
    mask = np.ones((3, 14), np.int64)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    images = np.random.RandomState(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
    return ids, types, mask, images


def long_inputs():
    """Decoder ids [2, 40], no padding: longer than the rescaled cases' original rotary window (16)."""
    return np.random.RandomState(1).randint(0, 101, (2, 40))


def write(out: Path) -> None:
    import torch
    import transformers

    ids, types, mask, images = inputs()
    for case, (arch, cfg, seed) in CASES.items():
        torch.manual_seed(seed)
        config_cls = getattr(transformers, next(c for prefix, c in CONFIGS.items() if arch.startswith(prefix)))
        model = getattr(transformers, arch)(config_cls(**cfg))
        if arch.startswith(DECODERS):
            # transformers starts biases at zero, where an import that dropped them would still match
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith(".bias"):
                        p.normal_(0.0, 0.5)
        model.eval()
        model.save_pretrained(out / case, safe_serialization=True)
        with torch.no_grad():
            if arch.startswith("ViT"):
                ref = model(pixel_values=torch.tensor(images.transpose(0, 3, 1, 2)), output_hidden_states=True)
            elif arch.startswith(DECODERS):        # causal: padding at the ends of rows
                ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
                long_logits = model(input_ids=torch.tensor(long_inputs())).logits.numpy()
            else:
                ref = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                            attention_mask=torch.tensor(mask), output_hidden_states=True)
        arrays = {"hidden": ref.hidden_states[-1].numpy()}
        for name in ("last_hidden_state", "pooler_output", "logits"):
            if getattr(ref, name, None) is not None:
                arrays[name] = getattr(ref, name).numpy()
        if arch.startswith(DECODERS):
            arrays["long_logits"] = long_logits
        if arch.startswith("Bert"):
            bert = model if arch == "BertModel" else model.bert
            # the first layer's query weight as torch stores it ([out, in]), for the warm-start test
            arrays["layer0_query_weight"] = bert.encoder.layer[0].attention.self.query.weight.detach().numpy()
        np.savez(out / case / "reference.npz", **arrays)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
