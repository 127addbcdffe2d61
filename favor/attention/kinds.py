"""Attention kinds: exact softmax, ReLU/ELU linear attention, and random-feature attention.

Every kind is called the same way:

    out = attn(q, k, v, mask=None, causal=False, rng=None, step=None, draw=None, query_mask=None, stats=None)
    # q [B, Lq, H, D], k/v [B, Lk, H, D(v)] -> [B, Lq, H, Dv]

`mask` is a key-padding mask [B, Lk] (True = real token): padded keys are removed from numerator and
denominator and from every statistic (stabilisers, data-dependent fits). `query_mask` [B, Lq] marks
the real queries, which the data-dependent fits use (in self-attention pass the same mask as both;
nothing guesses it from the shapes). With `causal=True` the queries are aligned to the last keys
(query i sees keys ≤ i + Lk − Lq) and every output depends on its past only, fitted parameters
included: data-dependent kinds then need `stats`, statistics that do not come from the sequence being
attended (running statistics a model keeps, or `attn.statistics(...)` of a prefix or of other data).
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import jax
import jax.numpy as jnp

from favor import kernels
from favor.attention import (bidirectional, causal as causal_lib, decoding, documents, floor as floor_lib, fused,
                             linear, schedule, sequence, tpu, window as window_lib)
from favor.kernels.base import pytree_dataclass

def check_qkv(q, k, v, mask, query_mask=None):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects q [B, Lq, H, D], k and v [B, Lk, H, D(v)]; "
                         f"got shapes {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must agree on batch, heads and head dim; got {q.shape} and {k.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, length and heads; got {k.shape} and {v.shape}")
    if mask is not None and tuple(jnp.shape(mask)) != (k.shape[0], k.shape[1]):
        raise ValueError(f"mask is a key-padding mask [B, Lk] = {(k.shape[0], k.shape[1])}; "
                         f"got shape {jnp.shape(mask)}")
    if query_mask is not None and tuple(jnp.shape(query_mask)) != (q.shape[0], q.shape[1]):
        raise ValueError(f"query_mask marks the real queries, [B, Lq] = {(q.shape[0], q.shape[1])}; "
                         f"got shape {jnp.shape(query_mask)}")


def check_causal_lengths(q, k):
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"causal attention aligns queries to the last keys and needs Lq ≤ Lk; "
                         f"got Lq = {q.shape[1]}, Lk = {k.shape[1]}")


def document_runs(segment_ids, q, k, causal):
    """segment_ids [B, Lk] (each token's document; None: one document per row) -> the runs the passes
    take (favor.attention.documents.runs), or None. A query sees only the keys of its own document."""
    if segment_ids is None:
        return None
    seg = documents.check_segments(segment_ids, k.shape[0], k.shape[1])
    if not causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"segment_ids mark the documents of one sequence, so bidirectional attention with them "
                         f"needs Lq = Lk; got Lq = {q.shape[1]}, Lk = {k.shape[1]}")
    return documents.runs(seg)


def last_document(valid, segment_ids, k):
    """The prefill's key mask: `valid` narrowed to the prompt's last document when segment_ids are given."""
    if segment_ids is None or k.shape[1] == 0:
        return valid
    r = documents.runs(documents.check_segments(segment_ids, k.shape[0], k.shape[1]))
    last = r == r[:, -1:]
    return last if valid is None else jnp.asarray(valid, bool) & last


def _to_bhld(a):
    return jnp.swapaxes(a, 1, 2)


class Attention:
    """Base: holds the options users passed; subclasses implement __call__."""

    name = ""
    OPTIONS: dict[str, Any] = {}
    data_dependent = False      # True: the feature map is fitted to the data (see `stats`)
    SPEC_OPTION = None          # the option a kind spec's ':variant' sets (favor.attention.parse_spec)

    def __init__(self, **options):
        self.options = options

    @classmethod
    def option_note(cls, key):
        """Why this kind has no option `key` that other kinds take (None: nothing to add)."""
        if key == "impl":
            return (f"impl chooses between XLA and a fused kernel, which exists for softmax (cuDNN) and the "
                    f"positive exponential kinds ({', '.join(fused_kinds())}); {cls.name} runs on XLA, with "
                    "no impl option")
        return None

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, {self.options})"


class Softmax(Attention):
    """Exact softmax attention, the baseline (jax.nn.dot_product_attention). impl: "xla" or "cudnn"
    (cuDNN's fused flash attention: a GPU, bf16/fp16, equal head dims of 64 or 128, no padding mask, Lq = Lk
    when causal). "auto" is XLA: cuDNN through this layer is not yet measured (favor.bench accel times cuDNN
    directly). `window` w > 0: sliding-window softmax, each query attending to the keys with |i − j| ≤ w
    (causal: its last w + 1), the "band only" baseline of the window hybrids (w ≥ L − 1: plain softmax)."""

    name = "softmax"
    OPTIONS = {"impl": "auto", "window": 0}

    def __init__(self, **options):
        super().__init__(**options)
        self.impl = _choice(self.name, "impl", options.get("impl", "auto"), SOFTMAX_IMPLS)
        self.window = window_lib.check_window(self.name, options.get("window", 0))
        if self.window and self.impl == "cudnn":
            raise ValueError("softmax: impl='cudnn' runs without a window (window=0); impl='auto' runs the band")

    def _cudnn(self, q, k, v, mask, causal):
        fits = (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and mask is None
                and q.shape[-1] == v.shape[-1] and q.shape[-1] in (64, 128)
                and not (causal and q.shape[1] != k.shape[1]))
        if self.impl == "cudnn" and not fits:
            raise ValueError("softmax: impl='cudnn' needs a GPU, bf16 or fp16 inputs, equal head dims of 64 or "
                             "128, no padding mask and Lq = Lk when causal; impl='auto' falls back to XLA")
        return self.impl == "cudnn"

    def _sequence_sharded(self, q, k, v, mask, causal, runs):
        if self.impl == "cudnn":
            refuse_sequence_axis(self.name, "impl='cudnn' runs on one device's whole sequence")
        if q.shape[1] != k.shape[1]:
            refuse_sequence_axis(self.name, f"queries and keys differ in length ({q.shape[1]}, {k.shape[1]})")
        return sequence.softmax(q, k, v, mask, runs, causal, q.shape[-1] ** -0.5, self.window)

    def __call__(self, q, k, v, mask=None, causal=False, rng=None, step=None, draw=None, query_mask=None,
                 stats=None, segment_ids=None):
        check_qkv(q, k, v, mask, query_mask)
        runs = document_runs(segment_ids, q, k, causal)
        if runs is not None and self.impl == "cudnn":
            raise ValueError("softmax: impl='cudnn' runs without segment_ids (cuDNN's fused attention here takes "
                             "no document mask); impl='auto' runs packed documents on XLA")
        if sequence.axis_size() > 1:
            return self._sequence_sharded(q, k, v, mask, causal, runs)
        if not self.window and self._cudnn(q, k, v, mask, causal):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        m = None if mask is None else jnp.asarray(mask, bool)[:, None, None, :]
        lq, lk = q.shape[1], k.shape[1]
        if runs is not None:      # queries aligned to the last keys, as the causal mask below
            same = documents.same_document(runs[:, lk - lq:], runs)[:, None]
            m = same if m is None else m & same
        if causal:
            check_causal_lengths(q, k)
            tri = jnp.tril(jnp.ones((lq, lk), bool), k=lk - lq)[None, None]
            m = tri if m is None else m & tri
        if self.window:
            if not causal and lq != lk:
                raise ValueError(f"softmax with window={self.window}: the band relates positions of one sequence, "
                                 f"so bidirectional attention needs Lq = Lk; got {lq} and {lk}")
            rel = jnp.arange(lk)[None, :] - (jnp.arange(lq)[:, None] + lk - lq)      # j − i in positions
            band = ((rel >= -self.window) & (rel <= self.window))[None, None]
            m = band if m is None else m & band
        # dot_product_attention wants one head dim for q, k and v: zero-pad the smaller side
        # (zeros change no score, and the scale stays 1/√D of the real head dim).
        d, dv = q.shape[-1], v.shape[-1]
        pad = lambda a, n: jnp.pad(a, ((0, 0),) * 3 + ((0, n - a.shape[-1]),))
        width = max(d, dv)
        out = jax.nn.dot_product_attention(pad(q, width), pad(k, width), pad(v, width), mask=m,
                                           scale=d ** -0.5)[..., :dv]
        if mask is not None:   # a query with no valid key attends to nothing: 0, not NaN
            seen = jnp.asarray(mask, bool)
            if self.window or runs is not None:          # the valid keys each query's band holds (m has the padding in it)
                sees = jnp.any(m, -1)[:, 0]                                           # [B, Lq]
                out = jnp.where(sees[:, :, None, None], out, 0.0)
            elif causal:
                seen = linear.cumulative(seen, jnp.logical_or, False, axis=1)[:, k.shape[1] - q.shape[1]:]
                out = jnp.where(seen[:, :, None, None], out, 0.0)
            else:
                out = jnp.where(jnp.any(seen, -1)[:, None, None, None], out, 0.0)
        return out


def refuse_sequence_axis(kind, why):
    raise ValueError(f"{kind}: mesh.sequence={sequence.axis_size()} shards the sequence, but {why}; "
                     f"run it with mesh.sequence=1")


class FeatureAttention(Attention, abc.ABC):
    """Linear attention over a feature map given in log space; subclasses give the map.

    Options: chunk_size (tokens per chunk of the passes over L; None: each pass's own, the fastest
    measured: causal 64; bidirectional the whole length while the feature arrays are small,
    else 512 (bidirectional.WHOLE_ARRAY_ELEMENTS); ReLU/ELU's bidirectional the whole length), causal_path
    ("auto", "fast", "exact": see favor.attention.causal.causal_maps; "auto" is exact for any input;
    for ReLU/ELU "auto" is causal_lib.causal_plain, their features used without log space, where their
    range allows) and
    causal_span (tokens per step of the causal scan, a whole number of chunks; None: 512).

    `window` w > 0 makes the weights exact softmax exp(qᵀk/√D) for |i − j| ≤ w (causal: the last w + 1
    keys) and the kind's feature products for every other key (favor.attention.window). `window_mix`
    says how the two parts meet: "shared" (one normaliser over both: for the random-feature kinds, whose
    products estimate exp(qᵀk/√D), an estimate of softmax with its band exact) or "learned" (LoLCATs:
    the band's weights γ_h·exp(qᵀk/√D − m_i), m_i the row's largest band score, beside the unscaled
    feature products, one normaliser; γ_h = sigmoid(mix logit) per head, a parameter of the layer, passed
    as `mix`; positive kinds only)."""

    positive = True
    OPTIONS = {"chunk_size": None, "causal_path": "auto", "causal_span": None, "window": 0,
               "window_mix": "shared"}
    BIDIRECTIONAL_CHUNK = "auto"   # the bidirectional pass's default (bidirectional.bidirectional_maps; None: whole L)
    CAUSAL_CHUNK = causal_lib.CAUSAL_CHUNK   # the causal pass's default chunk
    # The fast causal path's guarantee needs every key log-feature finite (each feature's reference is
    # then reached by a real key); maps with exact zero features (ElementwiseAttention) run "auto" as
    # causal_lib.causal_plain on their `phi` (or "exact" outside its range).
    finite_features = True

    def __init__(self, **options):
        super().__init__(**options)
        chunk = options.get("chunk_size")
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"{self.name}: chunk_size must be a positive integer (or None: each pass's "
                             f"default); got {chunk!r}")
        self.chunk_size = chunk or self.CAUSAL_CHUNK
        self.bidirectional_chunk = chunk or self.BIDIRECTIONAL_CHUNK
        span = options.get("causal_span")
        if span is not None and (not isinstance(span, int) or isinstance(span, bool) or span < 1):
            raise ValueError(f"{self.name}: causal_span must be a positive integer (or None: "
                             f"{causal_lib.CAUSAL_SPAN}); got {span!r}")
        self.causal_span = span
        self.causal_path = options.get("causal_path", "auto")
        if self.causal_path not in causal_lib.PATHS:
            raise ValueError(f"{self.name}: unknown causal_path {self.causal_path!r}; "
                             f"valid: {', '.join(causal_lib.PATHS)}")
        self.window = window_lib.check_window(self.name, options.get("window", 0))
        self.window_mix = _choice(self.name, "window_mix", options.get("window_mix", "shared"),
                                  window_lib.MIXES)
        self._check_mix()

    @property
    def mixes(self):
        """Whether the layer holding this kind keeps a learned window mix (`mix_init`, passed as `mix`)."""
        return bool(self.window) and self.window_mix == "learned"

    def _check_mix(self):
        # the sign-indefinite kinds' floor bounds a denominator of softmax's scale, which the learned
        # mix's rescaled band is not
        if self.window_mix == "learned" and not self.positive:
            raise ValueError(f"{self.name}: window_mix='learned' needs a positive kind (its denominator "
                             "has no floor); window_mix='shared' runs it")

    def mix_init(self, heads):
        """The learned window mix's initial logits [heads]: γ = sigmoid(logit) = window_lib.MIX_START."""
        return jnp.full((heads,), window_lib.MIX_LOGIT, jnp.float32)

    def band_inputs(self, q, k):
        """x, y [B, H, L, D] float32 with xᵀy = qᵀk/√D: what the window's exact band reads."""
        s = q.shape[-1] ** -0.25
        return _to_bhld(q).astype(jnp.float32) * s, _to_bhld(k).astype(jnp.float32) * s

    def _log_mix(self, mix, heads):
        """log γ_h [H] of the learned window mix (`mix`: the logits; None: the initial ones); None for
        the shared normaliser."""
        if not self.mixes:
            return None
        return jax.nn.log_sigmoid(self.mix_init(heads) if mix is None else jnp.asarray(mix, jnp.float32))

    def _window_path(self):
        # maps with exact zero features have no reference the fast log-space path is guaranteed to
        # reach (see ElementwiseAttention); their off-band pass takes the exact one
        return self.causal_path if self.finite_features or self.causal_path != "auto" else "exact"

    def _windowed(self, q, k, v, mask, causal, ctx, mix, runs=None):
        if not causal and q.shape[1] != k.shape[1]:
            raise ValueError(f"{self.name} with window={self.window}: the band relates positions of one "
                             f"sequence, so bidirectional attention needs Lq = Lk; got {q.shape[1]} and {k.shape[1]}")
        x, y = self.inputs(q, k)
        band = self.band_inputs(q, k)
        vv = _to_bhld(v)
        out = window_lib.attend(self.query_map, self.key_map, ctx, x, y, vv, mask, self.positive, self.window,
                                causal, self.chunk_size, self._window_path(), self.causal_span,
                                self.floor(x, y, vv, mask, causal, ctx, runs, gap=self.window + 1), band=band,
                                log_mix=self._log_mix(mix, q.shape[2]), runs=runs)
        return _to_bhld(out).astype(v.dtype)

    def context(self, q, k, mask=None, rng=None, step=None, query_mask=None, draw=None, stats=None,
                causal=False):
        """What one call fixes besides the inputs (fitted parameters and the draw); None here."""
        return None

    def inputs(self, q, k):
        """q [B, Lq, H, D], k [B, Lk, H, D] -> what the feature maps read, [B, H, L, D] float32."""
        return _to_bhld(q).astype(jnp.float32), _to_bhld(k).astype(jnp.float32)

    @abc.abstractmethod
    def query_map(self, ctx, x):
        """(log|φ_q| [B, H, L, F], sign or None) of `inputs`' queries, float32, each row from its own
        input only (the bidirectional pass applies it chunk by chunk)."""

    @abc.abstractmethod
    def key_map(self, ctx, y):
        """(log|φ_k| [B, H, L, F], sign or None) of `inputs`' keys, row by row as `query_map`."""

    def log_maps(self, q, k, ctx):
        """((log|φ_q| [B,H,Lq,F], sign or None), (log|φ_k| [B,H,Lk,F], sign or None)), float32, finite."""
        x, y = self.inputs(q, k)
        return self.query_map(ctx, x), self.key_map(ctx, y)

    @abc.abstractmethod
    def feature_dim(self, dim: int) -> int:
        """F for head dim `dim`."""

    def __call__(self, q, k, v, mask=None, causal=False, rng=None, step=None, draw=None, query_mask=None,
                 stats=None, mix=None, segment_ids=None):
        """`draw`: a stored `base_draw` (random-feature kinds) or a learned map's weights, used instead of
        drawing from rng; `mix`: the learned window mix's logits [H] (window_mix='learned');
        `segment_ids` [B, Lk]: packed documents (favor.attention.documents), a query seeing only the keys
        of its own."""
        check_qkv(q, k, v, mask, query_mask)
        if causal:
            check_causal_lengths(q, k)
        runs = document_runs(segment_ids, q, k, causal)
        ctx = self.context(q, k, mask, rng, step, query_mask, draw, stats, causal)
        if sequence.axis_size() > 1:
            return self._sequence_sharded(q, k, v, mask, causal, ctx, runs, mix)
        if self.window:
            return self._windowed(q, k, v, mask, causal, ctx, mix, runs)
        vv = _to_bhld(v)
        x, y = self.inputs(q, k)
        floor = self.floor(x, y, vv, mask, causal, ctx, runs)
        if causal:
            if self.causal_path == "auto" and not self.finite_features:
                # features with no exponential in them need no log space (causal_lib.causal_plain) unless
                # some are so small (or large) that their products leave float32's normal range: then
                # the exact log-space path. One decision for the whole input
                fq, fk = self.plain_maps(ctx, x, y)          # made once: the check and the plain path
                safe = causal_lib.plain_features_safe(fq, fk, mask)
                # The plain pass runs outside the cond, which only swaps in the exact path's result when the
                # features are out of range: as a branch of the cond it cost ReLU's layer 30.4 ms against
                # 25.7 outside (forward, L = 8192, round-robin). Out of range it runs on zeros (outputs 0,
                # finite gradients), so its unused result never makes a NaN gradient
                plain = causal_lib.causal_plain(jnp.where(safe, fq, 0.0), jnp.where(safe, fk, 0.0), vv, mask,
                                                self.positive, self.chunk_size, runs)
                exact = lambda plain, x, y, vv: (causal_lib.causal_maps(
                    self.query_map, self.key_map, ctx, x, y, vv, mask, self.positive, self.chunk_size, "exact",
                    self.causal_span) if runs is None else documents.causal_maps(
                    self.query_map, self.key_map, ctx, x, y, vv, mask, runs, self.positive, self.chunk_size, "exact",
                    self.causal_span))
                out = jax.lax.cond(safe, lambda plain, x, y, vv: plain, exact, plain, x, y, vv)
            elif runs is not None:
                out = documents.causal_maps(self.query_map, self.key_map, ctx, x, y, vv, mask, runs, self.positive,
                                            self.chunk_size, self.causal_path, self.causal_span, floor)
            else:
                out = causal_lib.causal_maps(self.query_map, self.key_map, ctx, x, y, vv, mask, self.positive,
                                         self.chunk_size, self.causal_path, self.causal_span, floor)
        elif runs is not None:
            # the causal sums plus those of the reversed sequence: twice a causal pass (a state per document
            # would need the documents' count, which only the data knows). Maps with exact zero features
            # take the exact log-space path, as their window does
            out = documents.bidirectional(self.query_map, self.key_map, ctx, x, y, vv, mask, runs, self.positive,
                                          self.chunk_size or causal_lib.CAUSAL_CHUNK,
                                          "exact" if "exact" in (self._window_path(), self.causal_path) else "auto",
                                          self.causal_span, floor)
        else:
            out = bidirectional.bidirectional_maps(self.query_map, self.key_map, ctx, x, y, vv, mask, self.positive,
                                            self.bidirectional_chunk, floor)
        return _to_bhld(out).astype(v.dtype)

    def _sequence_sharded(self, q, k, v, mask, causal, ctx, runs, mix=None):
        """The call with L split over the mesh's sequence axis (favor.attention.sequence)."""
        if q.shape[1] != k.shape[1]:
            refuse_sequence_axis(self.name, f"queries and keys differ in length ({q.shape[1]}, {k.shape[1]})")
        x, y = self.inputs(q, k)
        path = "exact" if "exact" in (self._window_path(), self.causal_path) else (self.causal_path if causal else "auto")
        extra = {}
        if self.window:
            extra = {"window": self.window, "band": self.band_inputs(q, k), "log_mix": self._log_mix(mix, q.shape[2])}
        if self.sequence_fused():
            forms = lambda ctx, x, y: (self.mech.query_log_linear(x, ctx.draw, ctx.params),
                                       self.mech.key_log_linear(y, ctx.draw, ctx.params))
            extra = {"fused": {"forms": forms, "precision": self.kernel_precision, "pass": kernels_module().document_pass}}
        out = sequence.linear(self.query_map, self.key_map, ctx, x, y, _to_bhld(v), mask, runs, self.positive, causal,
                              self.chunk_size or causal_lib.CAUSAL_CHUNK, path, self.causal_span, **extra)
        return _to_bhld(out).astype(v.dtype)

    def sequence_fused(self):
        """Whether a call over the sequence axis runs the fused kernel on each device: impl='pallas' only
        ('auto' runs XLA there: the kernel's sharded speed is not measured)."""
        return False

    def plain_maps(self, ctx, x, y):
        """(φ_q, φ_k) themselves, not in log space: what causal_lib.causal_plain takes for a kind without
        finite_features (ReLU/ELU: `phi` elementwise)."""
        return self.phi(x), self.phi(y)

    def floor(self, x, y, v, mask, causal, ctx, runs=None, gap=0):
        """What a sign-indefinite kind's ratio is floored by (floor_lib.jensen_floor: the bound
        n_i·exp(x_iᵀȳ_i) over the keys query i sees, x and y the kernel's inputs, those keys' value
        statistics, and the rows' feature norms for the rounding bound); None for positive kinds, whose
        denominators need no floor."""
        if self.positive:
            return None
        norms = floor_lib.log_norm_bounds(*self.query_map(ctx, x)), floor_lib.log_norm_bounds(*self.key_map(ctx, y))
        return floor_lib.jensen_floor(x, y, v, mask, causal, norms, runs, gap)

    # -- incremental decoding ----------------------------------------------------------------------
    def decode_context(self, dim, rng=None, step=None, draw=None, stats=None):
        """The context decoding uses (the same for every token)."""
        return None

    def decode_init(self, batch, heads, dim, dv):
        if self.window:
            return window_lib.decode_init(batch, heads, self.feature_dim(dim), dim, dv, self.window,
                                          signed=not self.positive)
        return decoding.decode_init(batch, heads, self.feature_dim(dim), dv, None if self.positive else dim)

    def decode_prefill(self, k, v, ctx=None, valid=None, segment_ids=None):
        """The state after keys k [B, L, H, D] and values v [B, L, H, Dv] (valid [B, L] or None), as
        decode_init then decode_step token by token would leave it, computed at once: a prompt's prefill.
        `segment_ids` [B, L]: a prompt of packed documents leaves the state of its last document."""
        valid = last_document(valid, segment_ids, k)
        if k.shape[1] == 0:
            return self.decode_init(k.shape[0], k.shape[2], k.shape[3], v.shape[3])
        _, y = self.inputs(k, k)
        lk, sk = self.key_map(ctx, y)            # keys only: a prompt's queries are the causal pass's
        if self.window:
            _, yb = self.band_inputs(k, k)
            return window_lib.decode_prefill(lk, sk, yb, _to_bhld(v), self.window, valid,
                                             signed=not self.positive)
        return decoding.decode_prefill(lk, sk, _to_bhld(v), valid, None if self.positive else k.shape[-1], y)

    def decode_step(self, state, q_t, k_t, v_t, ctx=None, valid=None, mix=None):
        """One token: q_t, k_t [B, 1, H, D], v_t [B, 1, H, Dv], valid [B] or None ->
        (out [B, 1, H, Dv], state); equal to the causal pass token by token."""
        (lq, sq), (lk, sk) = self.log_maps(q_t, k_t, ctx)
        first = lambda a: None if a is None else a[:, :, 0]
        if self.window:
            xb, yb = self.band_inputs(q_t, k_t)
            out, state = window_lib.decode_step(state, lq[:, :, 0], first(sq), lk[:, :, 0], first(sk),
                                                xb[:, :, 0], yb[:, :, 0], _to_bhld(v_t)[:, :, 0], valid,
                                                self.positive, self._log_mix(mix, q_t.shape[2]))
            return out[:, None].astype(v_t.dtype), state
        x, y = self.inputs(q_t, k_t)
        out, state = decoding.decode_step(state, lq[:, :, 0], first(sq), lk[:, :, 0], first(sk),
                                        _to_bhld(v_t)[:, :, 0], valid, self.positive, x[:, :, 0], y[:, :, 0])
        return out[:, None].astype(v_t.dtype), state


class ElementwiseAttention(FeatureAttention):
    """Linear attention with a fixed elementwise feature map φ ≥ 0, the same for queries and keys."""

    # ReLU's exact zeros (and ELU's underflow below −87) are −inf log-features: no feature reference
    # for the fast log-space causal path is then guaranteed to be reached by a key (a query whose
    # strongest feature no key carries would lose every term to underflow). Their features have no
    # exponential in them, so "auto" runs them as they are (causal_lib.causal_plain, with `phi`) while
    # every nonzero feature is in causal_lib.PLAIN_RANGE, else the exact path; "fast" and "exact" stay the
    # log-space paths
    finite_features = False
    # F = D features made by one elementwise op: too cheap for chunks to pay (ReLU at L = 8192 is slower
    # in chunks, forward and backward: BENCHMARKS.md, design-measurements), so the bidirectional pass
    # takes L at once
    BIDIRECTIONAL_CHUNK = None
    # their causal pass (causal_lib.causal_plain) takes the default chunk, C = 64, also the fastest for it
    # round-robin at L = 8192: ReLU forward 22.5 ms against 27.2 at C = 32 and 31.0 at C = 128, forward
    # and backward 106 against 123 and 108; ELU alike

    @staticmethod
    @abc.abstractmethod
    def phi(u):
        """The feature map, elementwise."""

    def feature_dim(self, dim):
        return dim

    def query_map(self, ctx, x):
        # Exact zeros (ReLU's) stay −inf: a query with no positive feature attends to nothing and
        # outputs 0, as 0/0 of the exact map would be read; a zero feature carries no key mass.
        # Double where: no inf reaches the backward pass.
        f = self.phi(x)
        return jnp.where(f > 0, jnp.log(jnp.where(f > 0, f, 1.0)), -jnp.inf), None

    def key_map(self, ctx, y):
        return self.query_map(ctx, y)


class ReluAttention(ElementwiseAttention):
    """φ(u) = relu(u): the ReLU linear-attention baseline of the GLUE tables."""

    name = "relu"
    phi = staticmethod(jax.nn.relu)


class EluAttention(ElementwiseAttention):
    """φ(u) = elu(u) + 1 (Katharopoulos et al.)."""

    name = "elu"
    # exp(u) below 0, not elu(u) + 1 = expm1(u) + 1, which rounds features below e^-17 to multiples of
    # 2^-24 (a relative error of 1e-3 in the outputs at query components near −20); exp of min(u, 0), so
    # the branch not taken never overflows into a NaN gradient
    phi = staticmethod(lambda u: jnp.where(u > 0, u + 1.0, jnp.exp(jnp.minimum(u, 0.0))))


class LearnedAttention(FeatureAttention):
    """Linear attention over a learned feature map (Hedgehog, T2R). Its weights are parameters of the
    layer that holds the kind (favor.models.layers.SelfAttention creates them from `init_weights` and
    passes them as `draw`, the slot a random-feature kind's stored ω takes), trained like any other
    parameter (`uptrain.trainable=feature_maps` in the attention-transfer stage). Called without them
    (a standalone call, decoding in a test) the kind uses the initial weights its `seed` gives.

    Options: num_features (F, the feature width) and seed, besides FeatureAttention's."""

    learned = True
    OPTIONS = {**FeatureAttention.OPTIONS, "num_features": 64, "seed": 0}

    def __init__(self, **options):
        super().__init__(**options)
        f = options.get("num_features", self.OPTIONS["num_features"])
        if not isinstance(f, int) or isinstance(f, bool) or f < self.FEATURE_STEP or f % self.FEATURE_STEP:
            raise ValueError(f"{self.name}: num_features must be a positive multiple of {self.FEATURE_STEP}; "
                             f"got {f!r}")
        self.num_features, self.seed = f, int(options.get("seed", 0))

    FEATURE_STEP = 1           # F is a multiple of it (Hedgehog's two halves: 2)

    def feature_dim(self, dim):
        return self.num_features

    @abc.abstractmethod
    def init_weights(self, key, heads: int, dim: int):
        """The map's initial weights for `heads` heads of dim `dim`: one float32 array."""

    def context(self, q, k, mask=None, rng=None, step=None, query_mask=None, draw=None, stats=None,
                causal=False):
        return draw

    def decode_context(self, dim, rng=None, step=None, draw=None, stats=None):
        return draw

    def weights(self, ctx, x):
        """The weights a call uses: the layer's (`ctx`), else the seed's initial ones for x's heads and dim."""
        if ctx is not None:
            return ctx
        return self.init_weights(jax.random.PRNGKey(self.seed), x.shape[1], x.shape[-1])

    @staticmethod
    def _start(key, shape, dim):
        """[.., D, F'] weights that start at the identity on the first min(D, F') columns (the map then
        starts from the inputs themselves, as LoLCATs starts Hedgehog) and N(0, 1/D) beyond."""
        eye = jnp.eye(shape[-2], shape[-1], dtype=jnp.float32)
        extra = jax.random.normal(key, shape, jnp.float32) * dim ** -0.5
        return jnp.where(jnp.arange(shape[-1]) < shape[-2], eye, extra)


class HedgehogAttention(LearnedAttention):
    """Hedgehog (Zhang et al., 2024): per head a trainable D × F/2 projection W for queries and another
    for keys, φ(x) = [softmax(xW), softmax(−xW)] over the F/2 columns; spiky and monotonic like the
    softmax it learns to imitate. Positive, with finite log-features (log_softmax), so every pass and
    stabiliser of the random-feature kinds applies. Weights [2, H, D, F/2] (queries, keys)."""

    name = "hedgehog"
    FEATURE_STEP = 2

    def init_weights(self, key, heads, dim):
        return self._start(key, (2, heads, dim, self.num_features // 2), dim)

    @staticmethod
    def _map(w, x):
        z = jnp.einsum("bhld,hdf->bhlf", x, w.astype(jnp.float32))
        return jnp.concatenate([jax.nn.log_softmax(z, -1), jax.nn.log_softmax(-z, -1)], -1)

    def query_map(self, ctx, x):
        return self._map(self.weights(ctx, x)[0], x), None

    def key_map(self, ctx, y):
        return self._map(self.weights(ctx, y)[1], y), None


class T2RAttention(LearnedAttention):
    """T2R (Kasai et al., 2021): φ(x) = ReLU(x W + b) per head, one map for queries and keys. Weights
    [H, D + 1, F] (W, then b as the last row; b starts at 0). ReLU's exact zeros make its features run
    as ReLU/ELU's do (causal_lib.causal_plain where their range allows, else the exact log-space path)."""

    name = "t2r"
    finite_features = False

    def init_weights(self, key, heads, dim):
        w = self._start(key, (heads, dim, self.num_features), dim)
        return jnp.concatenate([w, jnp.zeros((heads, 1, self.num_features), jnp.float32)], 1)

    def _features(self, ctx, x):
        w = self.weights(ctx, x).astype(jnp.float32)
        return jax.nn.relu(jnp.einsum("bhld,hdf->bhlf", x, w[:, :-1]) + w[:, None, -1])

    def plain_maps(self, ctx, x, y):
        return self._features(ctx, x), self._features(ctx, y)

    def query_map(self, ctx, x):
        f = self._features(ctx, x)          # exact zeros stay −inf, as ReLU's (ElementwiseAttention)
        return jnp.where(f > 0, jnp.log(jnp.where(f > 0, f, 1.0)), -jnp.inf), None

    def key_map(self, ctx, y):
        return self.query_map(ctx, y)


# How a random-feature kind runs: "xla" (favor.attention.linear), "pallas" (favor.attention.fused), or
# "auto": the fused kernel where it was measured faster than XLA, XLA elsewhere and for the kinds and
# options the kernel does not cover. AUTO_FUSED: backend -> {mode: the shortest key length measured
# faster}, forward+backward with the kernel's default products (tf32x3). On an H200: bidirectional
# faster from L = 4096 to 128K (BENCHMARKS.md accel-nvidia-h200-segments); causal faster at 16K, 32K and
# 128K (15.1 against 17.5 ms, 28.2 against 33.0, 108 against 129) and slower at 4K (13.2 against 12.1;
# accel-nvidia-h200-tuned-causal), so causal calls take the kernel from 16384 keys.
# "pallas-<precision>" runs the kernel's products at one of fused.PRECISIONS ("pallas": fused.PRECISION)
IMPLS = ("auto", "xla", "pallas", *(f"pallas-{p}" for p in fused.PRECISIONS))
# where impl='pallas' runs: Triton's kernels (favor.attention.fused) on a GPU and in interpret mode on a CPU,
# Mosaic's (favor.attention.tpu) on a TPU. AUTO_FUSED lists no TPU: compiled for TPU in the tests, not timed
# on one, so 'auto' stays on XLA there.
KERNEL_BACKENDS = ("gpu", "tpu", "cpu")


def kernel_backend():
    """The backend the kernels run on (jax.default_backend(); one place, which tests can replace)."""
    return jax.default_backend()


def kernels_module():
    """The backend's kernels: favor.attention.tpu (Mosaic) on a TPU, else favor.attention.fused; both give
    `attend`, `document_pass` and `prefill` with one contract."""
    return tpu if kernel_backend() == "tpu" else fused


SOFTMAX_IMPLS = ("auto", "xla", "cudnn")
AUTO_FUSED = {"gpu": {"bidirectional": 4096, "causal": 16384}}


@pytree_dataclass
class RandomFeatureContext:
    """What one call of random-feature attention fixes: fitted parameters and the draw."""
    params: Any
    draw: Any


class RandomFeatureAttention(FeatureAttention):
    """Linear attention over a kernel mechanism's random features (FAVOR, FAVOR+, ++, #, HRF, SimRF).

    Queries and keys are scaled by D^(−1/4) so that x_iᵀy_j = q_iᵀk_j/√D; one ω serves both.
    Data-dependent mechanisms are fitted per batch and head in float32 from the valid tokens
    (`mask`, `query_mask`; under stop_gradient unless fit_gradients=True), or from `stats` when given
    — always from `stats` in causal mode, where a fit on the sequence would read the future.
    `stats_momentum` is the running-average momentum of the statistics a causal model keeps.

    `window` as FeatureAttention's; with window_mix='shared' the band is exact and every other weight the
    kind's estimate, under one normaliser: an estimate of softmax.

    `num_features` is the width F of the feature arrays for every kind (one cost): FAVOR+, FAVOR++,
    FAVOR#, SimRF draw F projections; trig F/2 frequencies (sin and cos); antithetic FAVOR+ F/2 pairs;
    HRF the largest m whose hybrid features fit in F (`draws_for_width`; `num_draws` holds it).

    `impl`: "xla" (favor.attention.linear), "pallas" (the fused kernel, favor.attention.fused: the positive
    exponential kinds, no window, packed documents too; "pallas-<precision>" with its products at one of
    fused.PRECISIONS) or "auto" (the kernel where AUTO_FUSED lists it, XLA elsewhere and for documents).
    """

    OPTIONS = {"num_features": 256, "coupling": "orthogonal", "redraw": "step", "seed": 0,
               "fit_gradients": False, "chunk_size": None, "causal_path": "auto", "causal_span": None,
               "stats_momentum": 0.99, "window": 0, "window_mix": "shared", "impl": "auto"}
    mechanism = ""
    mechanism_options: dict[str, Any] = {}

    def __init__(self, **options):
        super().__init__(**options)
        self.num_features = int(options["num_features"])
        if self.num_features < 1:
            raise ValueError(f"{self.name}: num_features must be ≥ 1; got {options['num_features']!r}")
        self.coupling = kernels.couplings.check_coupling(options["coupling"])
        self.schedule = schedule.parse(options["redraw"])
        self.seed = int(options["seed"])
        self.fit_gradients = bool(options["fit_gradients"])
        self.stats_momentum = float(options.get("stats_momentum", 0.99))
        if not 0.0 <= self.stats_momentum < 1.0:
            raise ValueError(f"{self.name}: stats_momentum must be in [0, 1); got {self.stats_momentum!r}")
        self.mech = kernels.get(self.mechanism, **self.mechanism_options)
        self.positive = self.mech.positive
        self._check_mix()
        self.data_dependent = self.mech.data_dependent
        # one feature budget for every kind: num_features is the width F of the feature arrays (what the
        # [L, F] passes and the state cost); the mechanism's own count is derived from it
        self.num_draws = self.mech.draws_for_width(self.num_features)
        self._fixed_draws = {}                      # head dim -> the seed's base draw (`fixed_draw`)
        self.impl = _choice(self.name, "impl", options.get("impl", "auto"), IMPLS)
        self.kernel_precision = self.impl.partition("-")[2] or None     # None: fused.PRECISION when traced
        if self.impl.startswith("pallas") and self.fused_unavailable():
            raise ValueError(f"{self.name}: impl={self.impl!r} {self.fused_unavailable()}; "
                             "impl='auto' or 'xla' runs it on XLA")

    def feature_dim(self, dim):
        return self.mech.feature_dim(self.num_draws)

    # -- what a call fixes -------------------------------------------------------------------------
    def draw_key(self, rng, step):
        """The key ω is drawn from: evaluation (rng None) and 'fixed' use the seed, deterministic;
        'step' uses rng; 'every:N' folds rng with the window of `step`."""
        if not self.schedule.redraws or rng is None:
            return jax.random.PRNGKey(self.seed)
        if self.schedule.needs_step:
            if step is None:
                raise ValueError(f"{self.name}: redraw='{self.schedule}' needs the step number")
            return self.schedule.key(rng, step)
        return rng

    def scaled(self, q, k):
        s = q.shape[-1] ** -0.25
        return _to_bhld(q).astype(jnp.float32) * s, _to_bhld(k).astype(jnp.float32) * s

    def base_draw(self, key, dim):
        """The data-independent draw for head dim `dim` that a model keeps as state."""
        return self.mech.draw_base(key, self.num_draws, dim, self.coupling)

    def statistics(self, q, k, mask=None, query_mask=None, init=None):
        """The fit's sufficient statistics pooled over the batch, per head ([H, ...]): what a causal
        model keeps as running statistics, or what a caller fits on a prefix. Never differentiated."""
        x, y = jax.lax.stop_gradient(self.scaled(q, k))
        pool = lambda u: jnp.moveaxis(u, 0, 1).reshape(u.shape[1], -1, u.shape[-1])      # [H, B·L, d]
        heads = x.shape[1]
        pool_mask = lambda m, u: None if m is None else jnp.broadcast_to(
            jnp.asarray(m, bool)[None], (heads, *jnp.shape(m))).reshape(heads, -1)
        return self.mech.statistics(pool(x), pool(y), pool_mask(query_mask, x), pool_mask(mask, y), init=init)

    def update_statistics(self, running, q, k, mask=None, query_mask=None):
        """`running` averaged with this batch's statistics (momentum `stats_momentum`)."""
        new = self.statistics(q, k, mask, query_mask, init=running)
        return kernels.base.average_statistics(running, new, self.stats_momentum)

    def _params(self, x, y, mask, query_mask, stats, causal):
        if not self.data_dependent:
            # parameters of the dimension alone: one set for every batch and head (no batch dims), so a
            # feature map's projection is one operand of one matrix product, not a copy per head
            zero = jnp.zeros((1, x.shape[-1]), jnp.float32)
            return self.mech.fit(zero, zero)
        if stats is not None:
            batched = jax.tree.map(lambda a: a[None], stats) if stats.count.ndim == 1 else stats
            return self.mech.fit_statistics(batched)
        if causal:
            raise ValueError(
                f"{self.name} ({self.mech.name}) fits its feature map to the data; in causal mode a fit "
                "on the sequence would read the future. Pass stats= (running statistics, as the model "
                "zoo's causal layers keep; or attn.statistics(q, k) of a prefix or of other data)")
        per_head = lambda m, u: None if m is None else jnp.broadcast_to(
            jnp.asarray(m, bool)[:, None, :], u.shape[:-1])
        return self.mech.fit(x, y, per_head(query_mask, x), per_head(mask, y))

    def context(self, q, k, mask=None, rng=None, step=None, query_mask=None, draw=None, stats=None,
                causal=False) -> RandomFeatureContext:
        """Fit the mechanism (valid tokens, or `stats`) and draw ω (or adapt the stored `draw`)."""
        if self.data_dependent and stats is None and not causal and hasattr(self.mech, "layer_statistics"):
            # the fit's statistics read in the layer's own [B, L, H, D] layout (stats.layer_moments: the
            # transposed one costs FAVOR++ a fifth of its forward pass at L = 8192)
            s = q.shape[-1] ** -0.25
            xq, yk = q.astype(jnp.float32) * s, k.astype(jnp.float32) * s
            if not self.fit_gradients:
                xq, yk = jax.lax.stop_gradient(xq), jax.lax.stop_gradient(yk)
            params = self.mech.fit_statistics(self.mech.layer_statistics(xq, yk, query_mask, mask))
        else:
            x, y = self.scaled(q, k)
            if not self.fit_gradients:
                x, y = jax.lax.stop_gradient(x), jax.lax.stop_gradient(y)
            params = self._params(x, y, mask, query_mask, stats, causal)
        return RandomFeatureContext(params=params, draw=self._draw(params, rng, step, draw, q.shape[-1]))

    def fixed_draw(self, dim):
        """The base draw of the seed (what 'fixed' and evaluation use) for head dim `dim`, made once per
        instance and dim as concrete arrays: inside a jitted function it is a constant of the program,
        not a draw (an orthogonal QR among them) redone in every call. None for a mechanism whose draw
        depends on the fitted parameters (no base draw)."""
        if dim not in self._fixed_draws:
            try:
                with jax.ensure_compile_time_eval():     # concrete even while a caller is being traced
                    self._fixed_draws[dim] = self.base_draw(jax.random.PRNGKey(self.seed), dim)
            except NotImplementedError:
                self._fixed_draws[dim] = None
        return self._fixed_draws[dim]

    def _draw(self, params, rng, step, draw, dim):
        if draw is None and (not self.schedule.redraws or rng is None):
            draw = self.fixed_draw(dim)
        if draw is None:
            return self.mech.draw(self.draw_key(rng, step), self.num_draws, params, self.coupling)
        return self.mech.adapt_draw(draw, params)

    # -- the fused kernel ---------------------------------------------------------------------------
    @property
    def fused_features(self) -> bool:
        """Whether the kernel computes this kind's features (its maps are exponential log-linear forms)."""
        return isinstance(self.mech, kernels.exponential.ExponentialMechanism)

    def fused_unavailable(self):
        """Why the fused kernel (favor.attention.fused) cannot run this kind and options; None if it can."""
        if not self.fused_features:
            return (f"covers the positive exponential kinds ({', '.join(fused_kinds())}), not "
                    f"{self.name}'s {self.mech.name} features")
        if self.window:
            return "has no window band (window=0 only)"
        if self.fit_gradients:
            return "gives the fitted parameters no gradient (fit_gradients=False only)"
        if self.causal_path != "auto":
            return "has one causal path of its own (causal_path='auto' only)"
        return None

    def uses_fused(self, causal, q, k):
        """Whether a call runs the fused kernel: impl='pallas', or 'auto' where AUTO_FUSED lists the
        backend, the mode and a key length up to this call's, for a kind it covers; causal calls with
        Lq ≠ Lk (decoding after a prefix) stay on XLA."""
        if self.impl == "xla":
            return False
        if self.impl == "auto":
            least = AUTO_FUSED.get(kernel_backend(), {}).get("causal" if causal else "bidirectional")
            if least is None or k.shape[1] < least or self.fused_unavailable():
                return False
        self._check_backend()
        if causal and q.shape[1] != k.shape[1]:
            if self.impl == "auto":
                return False
            raise ValueError(f"{self.name}: impl={self.impl!r} runs causal calls with as many queries as keys "
                             f"(got Lq = {q.shape[1]}, Lk = {k.shape[1]}: queries after a prefix); impl='auto' "
                             "or 'xla' runs this call on XLA")
        return True

    def _check_backend(self):
        if kernel_backend() not in KERNEL_BACKENDS:
            raise ValueError(f"{self.name}: impl='pallas' runs on {', '.join(KERNEL_BACKENDS)} (the kernels lower "
                             f"through Triton on a GPU and Mosaic on a TPU, and run in interpret mode on a CPU), "
                             f"not on {kernel_backend()}; impl='xla' runs there")

    def sequence_fused(self):
        if not self.impl.startswith("pallas"):
            return False
        self._check_backend()
        return True

    def _fused_call(self, q, k, v, mask, causal, ctx, runs=None):
        x, y = self.scaled(q, k)
        xq, rq, pq, cq = self.mech.query_log_linear(x, ctx.draw, ctx.params)
        xk, rk, pk, ck = self.mech.key_log_linear(y, ctx.draw, ctx.params)
        vv = _to_bhld(v)
        forms, kernels = (xq, rq, pq, cq, xk, rk, pk, ck, vv, mask, causal), kernels_module()
        if runs is None:
            out, exceeded = kernels.attend(*forms, precision=self.kernel_precision)
        else:
            out, exceeded = fused.packed(*forms, runs, kernels.document_pass, precision=self.kernel_precision)
        if causal or runs is not None:
            # the rows past a key beyond its chunk's reference by more than the chunk form allows (in their
            # own batch and head, and document; documents: both modes are causal passes) take favor's XLA
            # pass, which runs only when some row needs it; every other row keeps the kernel's output
            args = (self.query_map, self.key_map, ctx, x, y, vv, mask)
            if runs is None:
                exact = lambda: causal_lib.causal_maps(*args, True, self.chunk_size, "auto", self.causal_span)
            elif causal:
                exact = lambda: documents.causal_maps(*args, runs, True, self.chunk_size, "auto", self.causal_span)
            else:
                exact = lambda: documents.bidirectional(*args, runs, True, self.chunk_size or causal_lib.CAUSAL_CHUNK,
                                                        "auto", self.causal_span)
            taken = lambda: jnp.where(exceeded[..., None], exact().astype(linear.F32), out)
            out = jax.lax.cond(jnp.any(exceeded), taken, lambda: out)
        return _to_bhld(out).astype(v.dtype)

    def __call__(self, q, k, v, mask=None, causal=False, rng=None, step=None, draw=None, query_mask=None,
                 stats=None, mix=None, segment_ids=None):
        if segment_ids is not None or sequence.axis_size() > 1:
            if segment_ids is not None and self.data_dependent and stats is None and draw is None:
                # the fit reads statistics of each row's tokens: on a packed row, of every document in it
                raise ValueError(f"{self.name} fits its feature map to each row's tokens, so with segment_ids "
                                 "one document's fit would read the others: pass stats= (running statistics, "
                                 "attn.statistics(q, k) of other data) or unpacked rows (data.packing='stream')")
            # Documents run on the fused kernel only when asked for (impl='pallas'): 'auto' keeps them on XLA,
            # as the document kernels' speed has not been measured on a GPU (AUTO_FUSED is a measured table)
            if (sequence.axis_size() == 1 and self.impl.startswith("pallas") and q.shape[1] == k.shape[1]
                    and self.uses_fused(causal, q, k)):
                check_qkv(q, k, v, mask, query_mask)
                runs = document_runs(segment_ids, q, k, causal)
                ctx = self.context(q, k, mask, rng, step, query_mask, draw, stats, causal)
                return self._fused_call(q, k, v, mask, causal, ctx, runs)
            return super().__call__(q, k, v, mask, causal, rng, step, draw, query_mask, stats, mix, segment_ids)
        if self.uses_fused(causal, q, k):
            check_qkv(q, k, v, mask, query_mask)
            if causal:
                check_causal_lengths(q, k)
            ctx = self.context(q, k, mask, rng, step, query_mask, draw, stats, causal)
            return self._fused_call(q, k, v, mask, causal, ctx)
        return super().__call__(q, k, v, mask, causal, rng, step, draw, query_mask, stats, mix)

    def denominator_rows(self, q, k, mask=None, causal=False, ctx=None):
        """(den ≤ 0, den below the floor) [B, H, Lq] booleans: which rows' estimated denominators are not
        positive, and which fall below the floor `floored_ratio` raises them to (the HRF paper's
        "negative fractions", Fig. 3). For diagnostics (favor.tools.inspect) of self-attention (Lq = Lk); the
        estimate over every key (a window's exact band, which only adds mass, is not counted); every row
        False for positive kinds. `ctx` the call's context (fitted parameters and draw)."""
        x, y = self.inputs(q, k)
        if self.positive:
            none = jnp.zeros(x.shape[:3], bool)
            return none, none
        if causal:
            zeros = jnp.zeros((*y.shape[:3], 0), jnp.float32)
            sums, scale = causal_lib.causal_sums(self.query_map, self.key_map, ctx, x, y, linear.ones_column(zeros),
                                             mask, self.chunk_size, "exact", self.causal_span)
            den = sums[..., 0]
        else:
            (lq, sq), (lk, sk) = self.log_maps(q, k, ctx)
            den, scale = bidirectional.bidirectional_denominators(lq, sq, lk, sk, mask)
        floor = floor_lib.jensen_floor(x, y, jnp.zeros((*y.shape[:3], 1), jnp.float32), mask, causal)
        return (den <= 0) & jnp.isfinite(scale), floor_lib.below_floor(den[..., None], scale, floor)

    def decode_prefill(self, k, v, ctx=None, valid=None, segment_ids=None):
        valid = last_document(valid, segment_ids, k)
        if k.shape[1] and self.uses_fused(False, k, k):
            _, y = self.scaled(k, k)
            tau, total = kernels_module().prefill(*self.mech.key_log_linear(y, ctx.draw, ctx.params), _to_bhld(v),
                                                  valid, precision=self.kernel_precision)
            return {"tau": tau, "sum": total}
        return super().decode_prefill(k, v, ctx, valid)

    def decode_context(self, dim, rng=None, step=None, draw=None, stats=None):
        zeros = jnp.zeros((1, 1, 1, dim), jnp.float32)
        params = self._params(zeros, zeros, None, None, stats, causal=True)
        return RandomFeatureContext(params=params, draw=self._draw(params, rng, step, draw, dim))

    def inputs(self, q, k):
        return self.scaled(q, k)

    def query_map(self, ctx, x):
        return self.mech.query_log_features(x, ctx.draw, ctx.params)

    def key_map(self, ctx, y):
        return self.mech.key_log_features(y, ctx.draw, ctx.params)


def _rf_kind(kind_name, mechanism, doc, extra_options=None, mech_options=None, spec_option=None):
    extra_options = extra_options or {}

    class Kind(RandomFeatureAttention):
        __doc__ = doc
        name = kind_name
        OPTIONS = {**RandomFeatureAttention.OPTIONS, **extra_options}
        SPEC_OPTION = spec_option

        def __init__(self, **options):
            self.mechanism, self.mechanism_options = mech_options(options) if callable(mech_options) \
                else (mechanism, {})
            super().__init__(**options)

    Kind.__name__ = Kind.__qualname__ = "".join(p.capitalize() for p in kind_name.replace("+", "plus")
                                                 .replace("#", "sharp").split("-")) + "Attention"
    return Kind


@functools.cache
def fused_kinds() -> tuple[str, ...]:
    """The kinds whose features the fused kernel computes (each with its default options), in KINDS order."""
    return tuple(cls.name for cls in KINDS if issubclass(cls, RandomFeatureAttention)
                 and cls(**cls.OPTIONS).fused_features)


def _choice(kind, key, value, allowed):
    if value not in allowed:
        raise ValueError(f"{kind}: unknown {key} {value!r}; valid: {', '.join(map(repr, allowed))}")
    return value


# Every kind redraws ω every step by default, the sign-indefinite ones too, although a fixed ω scored a
# little higher in the default job with qk_norm="l2" (3 seeds: trig 96.5 ± 1.2 % fixed, 95.0 ± 1.0 every
# step, 81 ± 16 every 100 steps; HRF 96.7 ± 0.3 fixed, 94.4 ± 2.1 every step): with one ω for the whole
# run the model learns to exploit it through the denominator's floor. On its own eval inputs and stored ω
# the fixed-ω trig model had up to 95 % of rows with a denominator ≤ 0 (floored) and an attention error
# against softmax of 0.9, so it no longer approximates softmax attention; the model redrawn every step
# has ≤ 1 % such rows and an error of 0.22 (favor+ on the same q, k: 0.28). A fresh ω each step is what
# keeps the estimator an estimator (README, "The kernel ablation").
Favor = _rf_kind("favor", "trig", "FAVOR: trigonometric random features (not positive; the denominator is floored).")
FavorPlus = _rf_kind(
    "favor+", "positive", "FAVOR+: positive random features.",
    {"antithetic": False, "importance_sampling": False},
    lambda o: ("positive", {"antithetic": o["antithetic"], "importance_sampling": o["importance_sampling"]}))
FavorPlusPlus = _rf_kind(
    "favor++", "oprf", "FAVOR++: optimal positive random features (OPRF).",
    {"importance_sampling": False},
    lambda o: ("oprf", {"importance_sampling": o["importance_sampling"]}))
FavorSharp = _rf_kind(
    "favor#", "sderf", "FAVOR#: dense-exponential random features (SDERF by default).",
    {"variant": "sderf", "importance_sampling": False},
    lambda o: (_choice("favor#", "variant", o["variant"], ("sderf", "saderf", "aderf")),
               {"importance_sampling": o["importance_sampling"]}), spec_option="variant")
def _hrf_mechanism(o):
    lam = _choice("hrf", "lambda_", o["lambda_"], ("angular", "gaussian", "cluster"))
    if lam == "cluster":
        return "hrf-cluster", {"query_clusters": o["clusters"], "key_clusters": o["clusters"]}
    return "hrf-" + lam, {"num_lambda_features": o["num_lambda_features"]}


# num_features is the feature width F, as for every kind: HRF-angular spends it on m = F / (8n)
# frequencies per base estimator and n λ projections (favor.kernels.hybrid: the indicator form, 8nm
# wide; HRF-gaussian F / (2(4n + 1)), HRF-cluster F / (4·clusters)). n = 1 by default: at equal width,
# HRF Theorem 3.1's MSE summed over attention rows (D = 16, queries and keys on S(r), random and
# aligned pairs) is least at n = 1 and grows with n (r = 1.5, F = 256: n = 1, 2, 3, 4, 7 give 0.057,
# 0.078, 0.106, 0.121, 0.212 relative): the base estimators' m falls as 1/n, which costs more than λ̂'s
# extra variance saves. The paper's HRF-A(16, 8) is num_features=1024, num_lambda_features=8.
Hrf = _rf_kind(
    "hrf", "hrf-angular", "Hybrid random features (not positive; the denominator is floored).",
    {"lambda_": "angular", "num_lambda_features": 1, "clusters": 2}, _hrf_mechanism, spec_option="lambda_")
def _simrf_mechanism(o):
    # SimRF is its coupling: with any other it is FAVOR+ (or FAVOR++), and an ablation listing simrf
    # would compare a kind with itself. Refuse rather than run another kind under this name.
    _choice("simrf", "coupling", o["coupling"], ("simplex", "simplex+"))
    return {"positive": "positive", "oprf": "oprf"}[_choice("simrf", "features", o["features"],
                                                            ("positive", "oprf"))], {}


SimRF = _rf_kind(
    "simrf", "positive", "SimRF: positive or OPRF features on simplex-coupled projections (simplex or simplex+).",
    {"features": "positive", "coupling": "simplex"}, _simrf_mechanism, spec_option="features")

KINDS = (Softmax, ReluAttention, EluAttention, Favor, FavorPlus, FavorPlusPlus, FavorSharp, Hrf, SimRF,
         HedgehogAttention, T2RAttention)

