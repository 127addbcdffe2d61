"""Decoding one token at a time: the state every linear kind carries (the running key and value sums on a
running stabiliser, and for the sign-indefinite kinds the floor's statistics), how a token is absorbed
into it and read from it, and the prefill that leaves it after a prompt; it agrees with the causal pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from favor.attention.linear import F32, NEG_INF, _with_sign, finite_or, ones_column, sg
from favor.attention.floor import Floor, log_norm_bounds, ratio

# -- decoding -----------------------------------------------------------------------------------------
def decode_init(batch, heads, features, dv, dim=None):
    """The causal state after no token: the running per-feature key maximum τ and the sum
    Σ_j φ_k(j)[v_j, 1] on its scale; with `dim` (sign-indefinite kinds) also what the denominator's floor
    needs (`jensen_floor`): the sums of the kernel's key inputs and of the values, their count, and the
    values' running minimum and maximum."""
    state = {"tau": jnp.full((batch, heads, features), NEG_INF, F32),
             "sum": jnp.zeros((batch, heads, features, dv + 1), F32)}
    if dim is not None:
        big = jnp.finfo(F32).max
        state.update(ysum=jnp.zeros((batch, heads, dim), F32), vsum=jnp.zeros((batch, heads, dv), F32),
                     count=jnp.zeros((batch, 1), F32), vmin=jnp.full((batch, heads, dv), big, F32),
                     vmax=jnp.full((batch, heads, dv), -big, F32), knorm=jnp.full((batch, heads), NEG_INF, F32))
    return state


FLOOR_STATE = ("ysum", "vsum", "count", "vmin", "vmax", "knorm")


def decode_floor(state, x, y, v, valid=None, norms=None, leaving=None):
    """(the floor's part of the state with key input y [B, H, D] and value v [B, H, Dv] counted, the
    `Floor` of query x [B, H, D]) for a state that keeps it (`decode_init(..., dim)`); ({}, None) else.
    norms: (log‖φ_q‖, log‖φ_k‖) [B, H] of this token's query and key (`log_norm_bounds`), for the floor's
    mass; `leaving` (a window's state): log‖φ_k‖ [B, H] of the key leaving the band (−inf: none), which
    the mass counts instead of this token's key (the band's keys carry no estimate's rounding)."""
    if "ysum" not in state:
        return {}, None
    w = jnp.ones((y.shape[0], 1), F32) if valid is None else jnp.asarray(valid, F32)[:, None]
    real = w[..., None] > 0
    v = v.astype(F32)
    new = {"ysum": state["ysum"] + w[..., None] * y.astype(F32), "vsum": state["vsum"] + w[..., None] * v,
           "count": state["count"] + w, "vmin": jnp.where(real, jnp.minimum(state["vmin"], v), state["vmin"]),
           "vmax": jnp.where(real, jnp.maximum(state["vmax"], v), state["vmax"])}
    n = jnp.maximum(new["count"], 1.0)
    log = jnp.log(n) + jnp.einsum("bhd,bhd->bh", x.astype(F32), new["ysum"]) / n
    mass = None
    if norms is not None:
        nq, nk = (sg(a.astype(F32)) for a in norms)
        added = jnp.where(w > 0, nk, NEG_INF) if leaving is None else sg(leaving.astype(F32))
        new["knorm"] = jnp.logaddexp(state["knorm"], added)
        mass = jnp.where(new["count"] > 0, nq + new["knorm"], NEG_INF)
    return new, Floor(log=jnp.where(new["count"] > 0, log, NEG_INF), mean=new["vsum"] / n[..., None],
                      low=new["vmin"], high=new["vmax"], log_mass=mass)


def decode_absorb(state, lk, sk, v):
    """The state after one more key: lk [B, H, F] (−inf: no key), sk its sign or None, v [B, H, Dv]."""
    tau = sg(jnp.maximum(state["tau"], lk))
    keep = jnp.where(jnp.isfinite(state["tau"]), jnp.exp(state["tau"] - finite_or(tau)), 0.0)
    fk = _with_sign(jnp.where(jnp.isfinite(lk), jnp.exp(lk - finite_or(tau)), 0.0), sk)
    total = state["sum"] * keep[..., None] + fk[..., None] * ones_column(v)[..., None, :]
    return {"tau": tau, "sum": total}


def decode_read(state, lq, sq):
    """Query lq [B, H, F] against the state: (out [B, H, Dv+1], log-scale [B, H]), the true sums being
    e^scale · out; −inf where no key was absorbed. The query's stabiliser knows the keys, as in the
    bidirectional pass."""
    tau = state["tau"]
    lqt = jnp.where(jnp.isfinite(tau), lq + finite_or(tau), NEG_INF)
    scale = sg(jnp.max(lqt, axis=-1))
    fq = _with_sign(jnp.exp(lqt - finite_or(scale)[..., None]), sq)
    return jnp.einsum("bhf,bhfd->bhd", fq, state["sum"]), scale


def decode_prefill(lk, sk, v, valid=None, dim=None, y=None):
    """The state `decode_step` reaches after absorbing keys lk [B, H, L, F | 1] (sign sk [B, H, L, F] or
    None), values v [B, H, L, Dv] and key inputs y [B, H, L, D] one at a time, computed at once (the
    prefill of a prompt): τ the keys' maximum, the sum of their features on it, and with `dim` the
    floor's sums. valid [B, L]: keys that count (the others are absorbed as no key, as decode_step does)."""
    b, h, l = v.shape[:3]
    lk = lk.astype(F32)
    if valid is not None:
        lk = jnp.where(jnp.asarray(valid, bool)[:, None, :, None], lk, NEG_INF)
    features = lk.shape[-1] if sk is None else sk.shape[-1]
    tau = sg(jnp.broadcast_to(jnp.max(lk, axis=2), (b, h, features)) if l else jnp.full((b, h, features), NEG_INF, F32))
    fk = _with_sign(jnp.where(jnp.isfinite(lk), jnp.exp(lk - finite_or(tau)[:, :, None]), 0.0), sk)
    state = {"tau": tau, "sum": jnp.einsum("bhlf,bhld->bhfd", jnp.broadcast_to(fk, (b, h, l, features)),
                                           ones_column(v))}
    if dim is not None:
        w = jnp.ones((b, l), F32) if valid is None else jnp.asarray(valid, F32)
        real = w[:, None, :, None] > 0
        v = v.astype(F32)
        big = jnp.finfo(F32).max
        state.update(ysum=jnp.einsum("bl,bhld->bhd", w, y.astype(F32)), vsum=jnp.einsum("bl,bhld->bhd", w, v),
                     count=jnp.sum(w, axis=1, keepdims=True),
                     vmin=jnp.min(jnp.where(real, v, big), axis=2, initial=big),
                     vmax=jnp.max(jnp.where(real, v, -big), axis=2, initial=-big),
                     knorm=sg(jax.nn.logsumexp(jnp.where(real[..., 0], log_norm_bounds(lk, sk), NEG_INF),
                                               axis=2)))
    return state


def decode_step(state, lq, sq, lk, sk, v, valid=None, positive=True, x=None, y=None):
    """One token: lq, lk [B, H, F], v [B, H, Dv], valid [B] or None -> (out [B, H, Dv], state).
    The same stabilisers as the causal pass with every key a chunk of its own: exact. x, y [B, H, D]:
    the kernel's inputs, for a state that keeps the denominator's floor (sign-indefinite kinds)."""
    lq, lk = lq.astype(F32), lk.astype(F32)
    if valid is not None:
        lk = jnp.where(jnp.asarray(valid, bool)[:, None, None], lk, NEG_INF)
    sums, floor = decode_floor(state, x, y, v, valid, (log_norm_bounds(lq, sq), log_norm_bounds(lk, sk)))
    state = {**decode_absorb(state, lk, sk, v), **sums}
    out, scale = decode_read(state, lq, sq)
    return ratio(out, positive, scale, floor), state
