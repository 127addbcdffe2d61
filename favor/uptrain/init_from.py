"""Where an uptraining run's parameters come from: `config.model.init_from`, parsed into an `Origin`.

    run:<workdir>          the newest whole checkpoint of a favor run (any attention kind)
    run:<workdir>@<step>   that step of it
    <dir>                  a favor checkpoint directory: <workdir>/checkpoints, or one step in it
    hf:<dir>               a Hugging Face BERT/ViT/GPT-2/Llama/Qwen2/Mistral directory (config.json + safetensors)

Parameters only: the optimizer starts fresh and the random features are drawn for the new kind (the
model's own init draws them). The source run's config comes from its checkpoint metadata; a parameter
whose shape differs from the new model's is an error naming its path and both shapes (and the source's
model sizes to set). A parameter the source lacks is kept fresh only when it is a task head (a GLUE
classifier on an MLM model, or one for another number of labels) or the query/key normalisation's
(`qk_norm` on a source without it), named in a log line; any other is an error. Source parameters the
new model does not take (the MLM head when fine-tuning on GLUE) are left out, also named.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from favor import attention as attention_lib
from favor import models
from favor.train.checkpoint import dotted, fingerprint
from favor.config.checks import ConfigError
from favor.models import lora
from favor.models.layers import is_feature_map_param, is_qk_norm_param

log = logging.getLogger("favor.train")

FORMS = ("'run:<workdir>' (its newest whole checkpoint), 'run:<workdir>@<step>', a favor checkpoint directory "
         "(<workdir>/checkpoints or one step in it), or 'hf:<Hugging Face model directory>'")
HEAD_PREFIXES = ("head", "classifier", "mlm_", "pooler", "ctc")   # task heads a new task may add fresh


@dataclasses.dataclass(frozen=True)
class Origin:
    """A parsed `init_from`: the checkpoint (or Hugging Face directory) a run's parameters come from."""
    spec: str
    kind: str                       # "run" (a favor checkpoint) or "hf"
    path: Path                      # run: the checkpoints directory; hf: the model directory
    step: int | None = None         # run: the step asked for (None: the newest whole one)
    workdir: Path | None = None     # run: the source run's workdir (its recorded tokenizer), when known


def parse(spec: str) -> Origin:
    """The source `spec` names; a ValueError that says which forms are allowed when it names none."""
    spec = str(spec)
    kind, sep, rest = spec.partition(":")
    if sep and kind == "hf":
        path = Path(rest).expanduser().absolute()
        if not rest or not path.is_dir():
            raise ValueError(f"{rest or '(empty)'} is not a directory (a Hugging Face model directory with "
                             f"config.json); expected {FORMS}")
        return Origin(spec, "hf", path)
    if sep and kind == "run":
        where, at, step = rest.rpartition("@") if "@" in rest else (rest, "", "")
        if at and not step.isdigit():
            raise ValueError(f"step {step!r} after '@' is not a number; expected {FORMS}")
        workdir = Path(where).expanduser().absolute()
        if not (workdir / "checkpoints").is_dir():
            raise ValueError(f"{workdir} is not a favor run directory (it has no checkpoints/); expected {FORMS}")
        return Origin(spec, "run", workdir / "checkpoints", int(step) if at else None, workdir)
    path = Path(spec).expanduser().absolute()
    if path.is_dir():
        if (path / "checkpoints").is_dir():
            return Origin(spec, "run", path / "checkpoints", None, path)
        if _is_step_dir(path):
            return Origin(spec, "run", path.parent, int(path.name), _workdir_of(path.parent))
        if any(_is_step_dir(p) for p in path.iterdir()):
            return Origin(spec, "run", path, None, _workdir_of(path))
        if (path / "config.json").exists():
            raise ValueError(f"{path} looks like a Hugging Face model directory: write 'hf:{spec}'")
    raise ValueError(f"expected {FORMS}")


def _is_step_dir(p: Path) -> bool:
    return p.name.isdigit() and (p / "state").is_dir() and (p / "meta").is_dir()


def _workdir_of(checkpoints: Path) -> Path | None:
    return checkpoints.parent if checkpoints.name == "checkpoints" else None


# -- reading a favor checkpoint ------------------------------------------------------------------------
def _flat(tree) -> dict:
    return {dotted(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@dataclasses.dataclass
class Checkpoint:
    """One step of a favor run's checkpoints: its metadata and the shapes of its parameters."""
    directory: Path
    step: int
    meta: dict
    param_shapes: dict              # dotted path -> (shape, dtype)

    @property
    def config(self) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(json.loads(self.meta["config"]))


def _steps(checkpoints: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if _is_step_dir(p)) if checkpoints.is_dir() else []


def _open(checkpoints: Path, step: int) -> Checkpoint:
    d = checkpoints / str(step)
    meta = json.loads((d / "meta" / "metadata").read_text())
    tree = ocp.StandardCheckpointer().metadata(d / "state").item_metadata
    tree = getattr(tree, "tree", tree)
    shapes = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in _flat(tree["params"]).items()}
    return Checkpoint(d, step, meta, shapes)


def _fingerprint_holds(restored, saved) -> bool:
    """Every restored leaf's fingerprint (as trainer checkpoints record one per numeric leaf of the whole
    state) is among the saved ones: a damaged parameter file changes its sums."""
    got = np.asarray(jax.device_get(fingerprint(restored)), np.float64)
    saved = np.asarray(saved, np.float64)
    return len(saved) > 0 and all(np.any(np.isclose(saved, g, rtol=1e-5, atol=1e-6)) for g in got)


def open_checkpoint(origin: Origin) -> Checkpoint:
    """The step `origin` names (the newest one with readable metadata when it names none)."""
    steps = _steps(origin.path)
    if not steps:
        raise ConfigError("model.init_from", origin.spec, f"{origin.path} holds no checkpoint steps")
    if origin.step is not None and origin.step not in steps:
        raise ConfigError("model.init_from", origin.spec, f"no step {origin.step} in {origin.path}; it has "
                         f"{', '.join(map(str, steps))}")
    for step in [origin.step] if origin.step is not None else reversed(steps):
        try:
            return _open(origin.path, step)
        except Exception as e:       # an unreadable newest step: the previous one, as resuming does
            if origin.step is not None:
                raise ConfigError("model.init_from", origin.spec, f"step {step} is unreadable ({e})") from None
            log.warning("init_from: step %d of %s is unreadable (%s); trying the previous one", step, origin.path, e)
    raise ConfigError("model.init_from", origin.spec, f"no readable checkpoint in {origin.path}")


MODEL_SIZE_KEYS = ("preset", "hidden", "num_layers", "heads", "mlp_dim", "vocab_size", "max_positions",
                   "type_vocab_size", "image_size", "patch_size", "channels", "num_classes", "num_labels")


def _sizes_hint(source_config, config) -> str:
    src, new = source_config.get("model", {}), config.model
    diff = [f"--config.model.{k}={src[k]}" for k in MODEL_SIZE_KEYS if k in src and k in new and src[k] != new[k]]
    return f" (the source's model: {' '.join(diff)})" if diff else ""


def match(have: dict, want: dict, spec: str, hint: str = "") -> tuple[list[str], list[str], list[str]]:
    """(paths to load, fresh head paths, source paths left out) for source parameter shapes `have` and the
    new model's `want` (dotted path -> (shape, dtype)); an error names the first path that cannot match."""
    load, fresh = [], []
    for path in sorted(want):
        if path in have:
            if have[path][0] != want[path][0] and path.startswith(HEAD_PREFIXES):
                fresh.append(path)        # a head for another label set (GLUE task → task): a new head
            elif have[path][0] != want[path][0]:
                raise ConfigError("model.init_from", spec, f"parameter {path} has shape {have[path][0]} in the "
                                 f"source and {want[path][0]} in this config's model{hint}")
            load.append(path)
        elif (path.startswith(HEAD_PREFIXES) or is_qk_norm_param(path) or lora.is_lora_param(path)
              or is_feature_map_param(path)):
            # a new head, qk_norm's parameters on a source without them, adapters, or a learned kind's
            # feature map on a source of another kind
            fresh.append(path)
        else:
            raise ConfigError("model.init_from", spec, f"this config's model has parameter {path} "
                             f"{want[path][0]}, which the source does not have{hint}")
    if not load:
        raise ConfigError("model.init_from", spec, f"no parameter of the source fits this config's model{hint}")
    dropped = sorted(set(have) - set(load))
    return load, fresh, dropped


def load_params(config, origin: Origin, params, shardings):
    """`params` (the new model's freshly initialised nnx.State of arrays) with every parameter the
    origin has put in place, restored straight into `shardings` (orbax partial restore: only the
    parameters are read, never the optimizer state)."""
    if origin.kind == "hf":
        return _load_hf(config, origin, params, shardings)
    ckpt = open_checkpoint(origin)
    src_config = ckpt.config
    hint = _sizes_hint(src_config, config)
    src_model, new_model = src_config.get("model", {}).get("name"), config.model.name
    if src_model != new_model:
        raise ConfigError("model.init_from", origin.spec, f"the source is a {src_model} run; this config builds a "
                         f"{new_model}")
    want_flat, sh_flat = _flat(params), _flat(shardings)
    want = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in want_flat.items()}
    # a LoRA source's adapters are folded into its kernels (below), never loaded as adapters: the new
    # model's own adapters, if it has any, start fresh on the merged weights
    adapters = sorted(k for k in ckpt.param_shapes if lora.is_lora_param(k))
    load, fresh, dropped = match({k: v for k, v in ckpt.param_shapes.items() if k not in adapters}, want,
                                 origin.spec, hint)

    tree = ocp.StandardCheckpointer().metadata(ckpt.directory / "state").item_metadata
    tree = getattr(tree, "tree", tree)
    wanted = set(load) | set(adapters)
    # a source adapter has no place in the new model: read whole on every device, folded below
    replicated = jax.sharding.NamedSharding(next(iter(sh_flat.values())).mesh, jax.sharding.PartitionSpec())

    def target(path, leaf):
        key = dotted(path)
        if key not in wanted:
            return None
        if key in want:
            return jax.ShapeDtypeStruct(tuple(leaf.shape), want[key][1], sharding=sh_flat[key])
        return jax.ShapeDtypeStruct(tuple(leaf.shape), ckpt.param_shapes[key][1], sharding=replicated)
    item = {"params": _prune(jax.tree_util.tree_map_with_path(target, tree["params"]))}
    restored = ocp.PyTreeCheckpointer().restore(
        ckpt.directory / "state", args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    got = _flat(restored["params"])
    if not _fingerprint_holds(list(got.values()), ckpt.meta.get("fingerprint", [])):
        raise ConfigError("model.init_from", origin.spec, f"the parameters of step {ckpt.step} do not match the "
                         f"fingerprint saved with them (a damaged checkpoint); choose another step with '@<step>'")
    if adapters:
        up = src_config.get("uptrain", {})
        scale = float(up.get("lora_alpha", 16.0)) / int(up.get("lora_rank", 8))
        merged = lora.merge({k: np.asarray(jax.device_get(v)) for k, v in got.items()}, scale)
        got = {k: jax.device_put(v.astype(want[k][1]), sh_flat[k]) for k, v in merged.items() if k in want}
        log.info("init_from: the source's LoRA adapters folded into %d kernels (scale %g)",
                 len(adapters) // 2, scale)
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [got[dotted(p)] if dotted(p) in got else leaf for p, leaf in paths]
    log.info("init_from %s: step %d of %s (a %s model with %s attention): %d parameters loaded", origin.spec,
             ckpt.step, origin.path, src_model, src_config.model.attention.kind, len(load))
    if fresh:
        log.info("init_from: newly initialised (not in the source): %s", ", ".join(fresh))
    if dropped:
        log.info("init_from: source parameters this model does not have, left out: %s", ", ".join(dropped))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _prune(tree):
    """`tree` without its None leaves and the dicts they leave empty (a partial-restore target)."""
    if isinstance(tree, dict):
        out = {k: _prune(v) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    if isinstance(tree, (list, tuple)):
        return {str(i): v for i, v in enumerate(map(_prune, tree)) if v is not None and v != {}}
    return tree


# what a Hugging Face decoder's config.json fixes about the computation and a shape check cannot catch
DECODER_KEYS = ("norm", "mlp", "positions", "rotary_base", "rope_scaling", "tie_embeddings", "use_bias", "qkv_bias",
                "norm_eps")


def _check_decoder(config, origin: Origin):
    """A decoder run from a Hugging Face decoder must compute as the checkpoint does: the same layout,
    rotary base and norm epsilon (a different rotary base loads every weight and silently changes the
    model). The error names each key that differs, with both values."""
    want = models.hf.decoder_config(origin.path)
    m = {k: v for k, v in config.model.to_dict().items() if k not in ("name", "preset", "init_from", "attention")}
    have = models.config("decoder", config.model.get("preset", "tiny"), **m)
    differ = [f"{k} (run {have[k]!r}, checkpoint {want[k]!r})" for k in DECODER_KEYS if k in want and have[k] != want[k]]
    if differ:
        raise ConfigError("model.init_from", origin.spec, f"the run's decoder computes differently from the "
                         f"checkpoint's in {', '.join(differ)}; set config.model's keys to the checkpoint's "
                         f"(configs/decoder_lm.py:init=<dir> takes them all from it)")


def _load_hf(config, origin: Origin, params, shardings):
    if config.model.name == "decoder":
        _check_decoder(config, origin)
    shared = ("head", "num_labels", "num_classes", "dropout", "attention_dropout", "dtype")
    keep = {k: v for k, v in config.model.to_dict().items() if k in shared}
    loaded = models.hf.load(origin.path, attention=attention_lib.block_options(config.model.attention), **keep)
    got = nnx.state(loaded, nnx.Param)
    want = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in _flat(params).items()}
    have = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in _flat(got).items()}
    match(have, want, origin.spec, " (set the config's sizes to the checkpoint's config.json)")
    log.info("init_from %s: a Hugging Face checkpoint", origin.spec)
    got_flat = _flat(got)
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [jax.device_put(np.asarray(got_flat[dotted(p)], leaf.dtype), s) if dotted(p) in got_flat else leaf
              for (p, leaf), s in zip(paths, jax.tree.leaves(shardings))]
    return jax.tree_util.tree_unflatten(treedef, leaves)
