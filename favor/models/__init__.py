"""The model zoo: BERT, ViT, a Conformer encoder and a causal decoder LM, each with any attention kind by
config.

    from favor import models
    model = models.get("bert", "base", rngs=nnx.Rngs(0), attention={"kind": "favor#"}, head="mlm")

Sizes live in `favor.config.presets`; any key of a family's defaults can be overridden.
"""

from __future__ import annotations

from favor.models import hf, lora
from favor.models.layers import FeatureDraw, FitStatistics, logical_axes, redraw_features
from favor.models.zoo import DTYPES, check, config, get, names, param_count, preset_names

__all__ = ["DTYPES", "check", "hf", "names", "preset_names", "config", "get", "param_count", "logical_axes",
           "redraw_features", "FeatureDraw", "FitStatistics"]
