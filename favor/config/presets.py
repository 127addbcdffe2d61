"""Every model size in one place: family -> defaults, and preset name -> the sizes that differ.

"tiny" is test-sized in every family (compiles and runs in seconds on a CPU); "small", "base" and
"large" are the published sizes: BERT-small (Turc et al. 2019, 4 layers × 512), BERT-base/large
(Devlin et al. 2019), ViT-S/16, ViT-B/16, ViT-L/16 (Dosovitskiy et al. 2021), and for the Conformer
"small" is CRT Table 6 (17 layers, 4 heads, 256 hidden) with "base"/"large" scaled from it. The
decoder's "gpt2" is GPT-2 small (Radford et al. 2019, 124M) in its own layout, "small" the Llama layout
at that width and depth, "mini" the size the local docstrings corpus trains.
"""

from __future__ import annotations

DEFAULT_ATTENTION = {"kind": "softmax"}

DEFAULTS = {
    "bert": dict(vocab_size=30522, hidden=768, num_layers=12, heads=12, mlp_dim=3072, max_positions=512,
                 type_vocab_size=2, dropout=0.1, attention_dropout=0.1, layer_norm_eps=1e-12,
                 attention=DEFAULT_ATTENTION, head="mlm", num_labels=2, pooler=True,
                 pool="cls", dtype="float32", param_dtype="float32"),
    "vit": dict(image_size=224, patch_size=16, channels=3, hidden=768, num_layers=12, heads=12,
                mlp_dim=3072, num_classes=1000, pool="cls", posemb="learn", pooler=False, dropout=0.0,
                attention_dropout=0.0, layer_norm_eps=1e-12, attention=DEFAULT_ATTENTION,
                dtype="float32", param_dtype="float32"),
    # Llama's layout by default; the "gpt2" preset switches to GPT-2's (LayerNorm, GELU, learned positions)
    "decoder": dict(vocab_size=32000, hidden=768, num_layers=12, heads=12, mlp_dim=2048, max_positions=2048,
                    norm="rms", mlp="swiglu", positions="rotary", rotary_base=10000.0, rope_scaling="",
                    tie_embeddings=False, use_bias=False, qkv_bias=False, norm_eps=1e-6, dropout=0.0,
                    attention_dropout=0.0, attention=DEFAULT_ATTENTION, dtype="float32", param_dtype="float32"),
    "conformer": dict(features=80, vocab_size=256, hidden=256, num_layers=17, heads=4, mlp_ratio=4,
                      conv_kernel=31, conv_norm="batch", subsampling_channels=256, dropout=0.1,
                      attention_dropout=0.0, layer_norm_eps=1e-5, attention=DEFAULT_ATTENTION,
                      self_attention=True, dtype="float32", param_dtype="float32"),
}

PRESETS = {
    "bert": {
        "tiny": dict(vocab_size=1024, hidden=64, num_layers=2, heads=2, mlp_dim=128, max_positions=128),
        "mini": dict(hidden=256, num_layers=4, heads=4, mlp_dim=1024),
        # Turc et al.'s BERT-Tiny width and depth (2 × 128) with the docstrings corpus's 1,000-piece
        # vocabulary and 128 positions: the model data=local pretrains to a useful level in minutes on 2 CPU
        # cores, where BERT-mini takes about an hour
        "local": dict(vocab_size=1000, hidden=128, num_layers=2, heads=2, mlp_dim=512, max_positions=128),
        "small": dict(hidden=512, num_layers=4, heads=8, mlp_dim=2048),
        "base": dict(),
        "large": dict(hidden=1024, num_layers=24, heads=16, mlp_dim=4096),
    },
    "vit": {
        "tiny": dict(image_size=32, patch_size=4, hidden=64, num_layers=2, heads=2, mlp_dim=128,
                     num_classes=10),
        "mini": dict(hidden=192, num_layers=12, heads=3, mlp_dim=768),           # ViT-Ti/16
        "small": dict(hidden=384, num_layers=12, heads=6, mlp_dim=1536),         # ViT-S/16
        "base": dict(),                                                          # ViT-B/16
        "large": dict(hidden=1024, num_layers=24, heads=16, mlp_dim=4096),       # ViT-L/16
    },
    "decoder": {
        "tiny": dict(vocab_size=256, hidden=64, num_layers=2, heads=2, mlp_dim=128, max_positions=256),
        "mini": dict(vocab_size=4000, hidden=256, num_layers=4, heads=4, mlp_dim=704, max_positions=512),
        # the Llama layout at GPT-2 small's width and depth (12 × 768, SwiGLU 2048 ≈ GPT-2's 3072 GELU)
        "small": dict(),
        "gpt2": dict(vocab_size=50257, hidden=768, num_layers=12, heads=12, mlp_dim=3072, max_positions=1024,
                     norm="layer", mlp="gelu", positions="learned", tie_embeddings=True, use_bias=True,
                     norm_eps=1e-5, dropout=0.1, attention_dropout=0.0),                    # GPT-2 small (124M)
    },
    "conformer": {
        "tiny": dict(features=16, vocab_size=32, hidden=64, num_layers=2, heads=2, conv_kernel=7,
                     subsampling_channels=32),
        "mini": dict(hidden=144, num_layers=8, heads=4, subsampling_channels=144),
        "small": dict(),                                                          # CRT Table 6
        "base": dict(hidden=512, num_layers=17, heads=8, subsampling_channels=512),
        "large": dict(hidden=1024, num_layers=17, heads=16, subsampling_channels=1024),
    },
}


def sizes(family: str, preset: str) -> dict:
    """The family's defaults with the preset's sizes over them; an unknown family or preset is a ValueError
    naming the valid ones. Pure data: configs read it without importing JAX."""
    if family not in PRESETS:
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(PRESETS)}")
    if preset not in PRESETS[family]:
        raise ValueError(f"unknown {family} preset {preset!r}; valid: {', '.join(PRESETS[family])}")
    return {**DEFAULTS[family], **PRESETS[family][preset]}
