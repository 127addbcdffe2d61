"""Every attention kind by the name users type, and the two ways tools name one: a kind spec on the
command line (`kind[:variant][@window]`) and a config's attention block."""

from __future__ import annotations

from favor import strings
from favor.attention import qknorm, schedule
from favor.attention.kinds import KINDS
from favor.registry import Registry

REGISTRY = Registry("attention kind", {cls.name: cls for cls in KINDS})
# the option each kind's spec variant sets (FAVOR#'s variant, HRF's lambda_, SimRF's features): in every
# config's attention block, so that a sweep or a flag can set it on the runs of the kind that takes it
SPEC_OPTIONS = tuple(dict.fromkeys(cls.SPEC_OPTION for cls in KINDS if cls.SPEC_OPTION))
# block keys whose empty value means "the kind's own" (impl: "auto")
OWN_DEFAULT = ("coupling", "redraw", "impl", *SPEC_OPTIONS)


names = REGISTRY.names      # every attention kind


def learned_kinds() -> tuple[str, ...]:
    """The kinds whose feature map is learned (parameters of the layer that holds them: Hedgehog, T2R)."""
    return tuple(name for name, cls in REGISTRY.entries.items() if getattr(cls, "learned", False))


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
    """A config's attention block (loading.attention) as `get` keywords: only the options the chosen
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


class BlockError(ValueError):
    """A bad attention block: `key` names the block's key at fault (None: the block as a whole) and `value`
    its value, so a config check reports `config.model.attention.<key>=<value>`."""

    def __init__(self, key, value, message):
        super().__init__(message)
        self.key, self.value = key, value


def read_block(block, *, from_config: bool) -> tuple[str, dict, dict]:
    """The one reading of an attention block -> (kind, the kind's options, the layer's query/key
    normalisation), checked by building the kind once (nothing is drawn).

    from_config: a config's `model.attention` block (loading.attention), which carries every kind's
    options: those the kind does not take are dropped (`block_options`; `ignored_block_options` names
    them) unless set to ask for what the kind cannot give (`_check_requests`: an error), and its redraw
    schedule is checked. Otherwise a model's own `attention=` (a kind name or a dict), where an option
    the kind does not take is an error. Errors are BlockErrors naming the key."""
    if isinstance(block, str):
        block = {"kind": block}
    if not hasattr(block, "keys") or "kind" not in block:
        raise BlockError(None, block, f"an attention block needs a 'kind' (one of {', '.join(REGISTRY.entries)}); "
                                      f"got {block!r}")
    block = dict(block)
    kind = block["kind"]
    if kind not in REGISTRY.entries:
        raise BlockError("kind", kind, f"unknown attention kind {kind!r}; valid: {', '.join(REGISTRY.entries)}")
    if from_config:
        if block.get("redraw"):
            try:
                schedule.parse(block["redraw"])
            except ValueError:
                raise BlockError("redraw", block["redraw"], f"must be {schedule.HELP}") from None
        _check_requests(block)
        block = block_options(block)
    options = {k: v for k, v in block.items() if k != "kind"}
    try:
        options, qk = qknorm.split(options)
    except qknorm.OptionError as e:
        raise BlockError(e.key, options.get(e.key), str(e)) from None
    try:
        get(kind, **options)
    except (TypeError, ValueError) as e:
        # the kind's message names the problem; the option that fails alone is the key to report
        alone = [k for k in options if _fails(kind, k, options[k])]
        raise BlockError(alone[0] if alone else None, options[alone[0]] if alone else block, str(e)) from None
    return kind, options, qk


# the impl values every kind honours: each runs on XLA ("auto" is XLA where a kind has nothing else)
PORTABLE_IMPLS = ("auto", "xla")


def _check_requests(block) -> None:
    """A config block carries every kind's options and drops those its kind does not take; but an option set
    to ask for something the kind cannot give is an error, not a silent no-op: an implementation other than
    XLA for a kind without one, a learned window mix without a window to mix."""
    kind, cls = block["kind"], REGISTRY.entries[block["kind"]]
    impl = block.get("impl")
    if impl and impl not in PORTABLE_IMPLS and "impl" not in cls.OPTIONS:
        takers = [name for name, c in REGISTRY.entries.items()
                  if "impl" in c.OPTIONS and not _fails(name, "impl", impl)]
        what = " (the fused kernel)" if impl.startswith("pallas") else ""
        where = f"impl={impl!r}{what} is for {', '.join(takers)}" if takers else f"no kind takes impl={impl!r}"
        raise BlockError("impl", impl, f"{kind} runs on XLA alone: impl must be '', "
                                       f"{' or '.join(map(repr, PORTABLE_IMPLS))} for it; {where}")
    if "window_mix" in cls.OPTIONS and block.get("window_mix") == "learned" and not block.get("window"):
        # the kind alone reads learned-without-window as "nothing to mix"; a config that asks for the mix (and
        # in attention transfer trains it) without a band asks for a parameter no layer then has
        raise BlockError("window_mix", "learned", "the learned mix weighs the window's exact band against the "
                                                  "kind's features, so it needs a window: model.attention.window "
                                                  "> 0 (exact softmax for |i − j| ≤ window); without one "
                                                  "window_mix must be 'shared'")


def _fails(kind, key, value) -> bool:
    try:
        get(kind, **{key: value})
    except (TypeError, ValueError):
        return True
    return False


def block_redraw(block) -> str:
    """The redraw schedule a run with this attention block uses: the block's, or the kind's own default
    (each random-feature kind's, from the measurements in its OPTIONS; "fixed" for kinds that draw
    nothing)."""
    return dict(block).get("redraw") or REGISTRY.entries[dict(block)["kind"]].OPTIONS.get("redraw", "fixed")
