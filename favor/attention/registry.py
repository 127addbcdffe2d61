"""Every attention kind by the name users type, and the two ways tools name one: a kind spec on the
command line (`kind[:variant][@window]`) and a config's attention block."""

from __future__ import annotations

from favor import strings
from favor.attention import qknorm
from favor.attention.kinds import KINDS
from favor.registry import Registry

REGISTRY = Registry("attention kind", {cls.name: cls for cls in KINDS})
# the option each kind's spec variant sets (FAVOR#'s variant, HRF's lambda_, SimRF's features): in every
# config's attention block, so that a sweep or a flag can set it on the runs of the kind that takes it
SPEC_OPTIONS = tuple(dict.fromkeys(cls.SPEC_OPTION for cls in KINDS if cls.SPEC_OPTION))
# block keys whose empty value means "the kind's own" (impl: "auto")
OWN_DEFAULT = ("coupling", "redraw", "impl", *SPEC_OPTIONS)


names = REGISTRY.names      # every attention kind


def get(kind, **options):
    """An attention kind with options (`kind` may come as a keyword, as in get(**block_options(block)));
    an unknown kind or option is a ValueError listing valid ones."""
    return REGISTRY.build(kind, **options)


def parse_spec(spec: str) -> tuple[str, dict]:
    """A kind spec as tools take it on the command line, `kind[:variant][@window]`, -> (kind, options):
    'favor#:saderf@16' -> ('favor#', {'variant': 'saderf', 'window': 16}); the variant sets the option
    the kind names (FAVOR#'s variant, HRF's lambda_, SimRF's features). A ValueError names a bad part
    and what is allowed."""
    body, at, window = str(spec).partition("@")
    kind, colon, variant = body.partition(":")
    if kind not in REGISTRY.entries:
        raise ValueError(f"unknown attention kind {kind!r} in {spec!r}; valid: {', '.join(REGISTRY.entries)}")
    cls, options = REGISTRY.entries[kind], {}
    if colon:
        if cls.SPEC_OPTION is None:
            with_variant = [name for name, c in REGISTRY.entries.items() if c.SPEC_OPTION]
            raise ValueError(f"{kind!r} has no variant (got {spec!r}); kinds with one: {', '.join(with_variant)}")
        options[cls.SPEC_OPTION] = variant
    if at:
        if "window" not in cls.OPTIONS or not window.isdigit():
            raise ValueError(f"{spec!r}: the part after '@' is a window, a whole number of tokens, for a "
                             f"linear kind (not softmax); got {window!r}")
        options["window"] = int(window)
    get(kind, **options)            # a bad variant fails here, with the values allowed
    return kind, options


def parse_specs(name: str, text) -> list[tuple[str, str, dict]]:
    """A list of kind specs ("/" or "," between them, favor.strings.items) -> [(spec, kind, options)], each
    read by `parse_spec`; an empty list or a bad spec is a ValueError naming `name`."""
    specs = strings.items(text)
    if not specs:
        raise ValueError(f"{name}: an empty list; valid: {'/'.join(REGISTRY.entries)} (each as "
                         f"kind[:variant][@window])")
    out = []
    for spec in specs:
        try:
            out.append((spec, *parse_spec(spec)))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out


def block_options(block) -> dict:
    """A config's attention block (configlib.attention) as `get` keywords: only the options the chosen
    kind takes, plus the layer's qk_norm, and no empty `coupling`, `redraw` or spec option (the kind's own).
    `ignored_block_options` names what was left out."""
    options = {k: v for k, v in dict(block).items() if not (k in OWN_DEFAULT and not v)}
    kind = options.get("kind")
    if kind not in REGISTRY.entries:
        raise ValueError(f"unknown attention kind {kind!r} (config.model.attention.kind); "
                         f"valid: {', '.join(REGISTRY.entries)}")
    accepted = {**REGISTRY.entries[kind].OPTIONS, **qknorm.OPTIONS}   # every kind takes the layer's qk_norm
    return {"kind": kind, **{k: v for k, v in options.items() if k in accepted}}


def ignored_block_options(block) -> list[str]:
    """The options of the block that its kind does not take (an empty coupling is not one: it means
    "the kind's own")."""
    taken = block_options(block)
    return sorted(k for k, v in dict(block).items() if k not in taken and (k not in OWN_DEFAULT or v))


def block_redraw(block) -> str:
    """The redraw schedule a run with this attention block uses: the block's, or the kind's own default
    (each random-feature kind's, from the measurements in its OPTIONS; "fixed" for kinds that draw
    nothing)."""
    return dict(block).get("redraw") or REGISTRY.entries[dict(block)["kind"]].OPTIONS.get("redraw", "fixed")
