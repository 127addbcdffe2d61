"""The sequence axis: attention over a sequence sharded across devices (context parallelism).

With `config.mesh.sequence = n` the activations' length axis is split over the mesh axis "sequence",
each device holding L/n consecutive tokens, and every attention call runs as a `jax.shard_map` that is
manual over that axis alone (batch, fsdp and tensor stay with XLA's partitioner).

Linear attention needs no keys or values from another device. A device's keys reduce to a carry — the
state of the document open at its last token, (seen, τ [H, F], T [H, F, Dv+1], run): what the causal
pass carries from span to span (favor.attention.documents) — and the devices all-gather these n carries,
O(n·H·F·(Dv+1)) numbers per layer whatever L. Each device folds the carries of the devices before it
(the one after a document boundary replaces the fold, one of the same document merges into it) and
runs its own tokens' causal pass from that carry: the result is the unsharded pass's, stabilisers
and document restarts included. Bidirectional adds the reversed fold over the devices after it (the
carry of each device's first document) and the reversed pass, as favor.attention.documents does on
one device. Softmax, the baseline: an all-gather of the keys, values and their masks.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from favor.attention import documents
from favor.attention.causal import CAUSAL_CHUNK
from favor.attention.floor import ratio
from favor.attention.linear import F32, NEG_INF, combine, ones_column

AXIS = "sequence"
BATCH_AXES = ("data", "fsdp")
# the trainer's mesh while it builds and traces a run's programs (`over`); a context variable, so each
# thread and task sees its own
_MESH = contextvars.ContextVar("favor_sequence_mesh", default=None)


@contextlib.contextmanager
def over(mesh):
    """Trace the attention layers of the programs built inside with `mesh`'s sequence axis. JAX's own
    current mesh (jax.set_mesh) serves as well; this one leaves everything else (Flax's variable
    shardings among them) as it is without a current mesh."""
    token = _MESH.set(mesh)
    try:
        yield mesh
    finally:
        _MESH.reset(token)


def current_mesh():
    """The mesh whose sequence axis applies: JAX's current mesh, else the one `over` set; None without."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty and AXIS in mesh.axis_names:
        return mesh
    mesh = _MESH.get()
    return mesh if mesh is not None and AXIS in mesh.axis_names else None


def axis_size() -> int:
    """The size of the current mesh's sequence axis (1 without one)."""
    mesh = current_mesh()
    return 1 if mesh is None else int(mesh.shape[AXIS])


def constrain(x):
    """[B, L, ...] activations sharded over the batch axes and, along L, the sequence axis (a no-op
    without a sequence axis): what keeps every token-wise layer on its device's tokens."""
    if axis_size() == 1:
        return x
    mesh = current_mesh()
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    spec = P(batch or None, AXIS)
    if isinstance(mesh, jax.sharding.Mesh):
        spec = jax.sharding.NamedSharding(mesh, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def check_length(length: int, n: int, what="attention"):
    if length % n:
        raise ValueError(f"mesh.sequence={n} must divide the sequence length; {what} got L = {length} "
                         f"(pad or pack rows to a multiple of {n})")


def _fold(carries, me, n, before):
    """The carry of the keys on the devices before `me` (before=True, in order) or after it (reversed),
    from every device's (carry, its first run, its last run) stacked along a leading device axis."""
    (seen, tau, total, run), first, last = carries
    carry = documents.empty_carry(*total.shape[1:3], tau.shape[-1], total.shape[-2], total.shape[-1])
    order = range(n) if before else range(n - 1, -1, -1)
    for e in order:
        mine = (seen[e], tau[e], total[e], run[e])
        # a device wholly inside the carried document adds to it; any other device starts a new one
        inside = (first[e] == last[e]) & (last[e] == carry[3])
        folded = documents.merge(carry, mine)
        new = jax.tree.map(lambda f, m: jnp.where(_rows(inside, f), f, m), folded, mine)
        use = (e < me) if before else (e > me)
        carry = jax.tree.map(lambda c, x: jnp.where(use, x, c), carry, new)
    return carry


def _rows(flag, like):
    return flag.reshape(flag.shape + (1,) * (like.ndim - flag.ndim))


def _gather(carry, first, last):
    return jax.lax.all_gather((carry, first, last), AXIS)


def linear_shard(query_map, key_map, ctx, x, y, v, valid, runs, positive, causal, chunk_size, path, span, n):
    """One device's share: x, y pytrees of [B, H, Lc, ·], v [B, H, Lc, Dv], valid [B, Lc] and runs [B, Lc]
    (the runs of the whole sequence: documents.runs before sharding) -> [B, H, Lc, Dv]."""
    me = jax.lax.axis_index(AXIS)
    v1 = ones_column(v)
    lk, sk = key_map(ctx, y)
    lk = jnp.where(valid[:, None, :, None], lk.astype(F32), NEG_INF)
    first, last = runs[:, 0], runs[:, -1]
    ahead = documents.summary(lk, sk, v1, runs == last[:, None], last)
    init = _fold(_gather(ahead, first, last), me, n, before=True)
    parts = [documents.causal_sums(query_map, key_map, ctx, x, y, v1, valid, runs, runs, chunk_size, path, span,
                                   init)]
    if not causal:
        rfirst, rlast = documents.RUN_TOP - last, documents.RUN_TOP - first     # the reversed numbering
        behind = documents.summary(lk, sk, v1, runs == first[:, None], rlast)
        init = _fold(_gather(behind, rfirst, rlast), me, n, before=False)
        parts.append(documents.after_sums(query_map, key_map, ctx, x, y, v1, valid, runs, chunk_size, path, span,
                                          init=init))
    out, scale = combine(parts)
    return ratio(out, positive, scale)


def linear(query_map, key_map, ctx, x, y, v, valid, runs, positive, causal, chunk_size=CAUSAL_CHUNK, path="auto",
           span=None):
    """[B, H, L, Dv]: linear attention (causal or bidirectional, packed documents by `runs` or one per
    row) over x, y, v whose L is split over the sequence axis of the current mesh."""
    n = axis_size()
    b, h, l = v.shape[:3]
    check_length(l, n)
    valid = jnp.ones((b, l), bool) if valid is None else jnp.asarray(valid, bool)
    runs = jnp.zeros((b, l), jnp.int32) if runs is None else runs
    seq = lambda a: P(None, None, AXIS)          # [B, H, L, ·]
    fn = lambda x, y, v, valid, runs, ctx: linear_shard(query_map, key_map, ctx, x, y, v, valid, runs, positive,
                                                        causal, chunk_size, path, span, n)
    mapped = jax.shard_map(fn, mesh=current_mesh(),
                           in_specs=(jax.tree.map(seq, x), jax.tree.map(seq, y), seq(v), P(None, AXIS),
                                     P(None, AXIS), jax.tree.map(lambda _: P(), ctx)),
                           out_specs=seq(v), axis_names={AXIS}, check_vma=False)
    return mapped(x, y, v, valid, runs, ctx)


def softmax(q, k, v, mask, runs, causal, scale):
    """[B, L, H, Dv]: exact softmax with q, k, v [B, L, H, ·] split along L over the sequence axis, each
    device's queries against the keys and values all devices gathered (the baseline's communication:
    the whole K and V to every device)."""
    n = axis_size()
    b, l = q.shape[:2]
    check_length(l, n)
    mask = jnp.ones((b, l), bool) if mask is None else jnp.asarray(mask, bool)
    runs = jnp.zeros((b, l), jnp.int32) if runs is None else runs

    def shard(q, k, v, mask, runs):
        lc = q.shape[1]
        keys = lambda a: jax.lax.all_gather(a, AXIS, axis=1, tiled=True)
        k_all, v_all, mask_all, runs_all = keys(k), keys(v), keys(mask), keys(runs)
        allowed = mask_all[:, None, :] & (runs[:, :, None] == runs_all[:, None, :])             # [B, Lc, L]
        if causal:
            rows = jax.lax.axis_index(AXIS) * lc + jnp.arange(lc)
            allowed = allowed & (jnp.arange(l)[None, None, :] <= rows[None, :, None])
        logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32), k_all.astype(F32)) * scale
        logits = jnp.where(allowed[:, None], logits, NEG_INF)
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        w = jnp.where(allowed[:, None], jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        den = jnp.sum(w, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", w, v_all.astype(F32))
        den = jnp.where(den == 0, 1.0, den)                  # a query with no key outputs 0
        return (out / jnp.moveaxis(den, 1, 2)[..., None]).astype(v.dtype)

    row = P(None, AXIS)
    return jax.shard_map(shard, mesh=current_mesh(), in_specs=(row, row, row, row, row),
                         out_specs=row, axis_names={AXIS}, check_vma=False)(q, k, v, mask, runs)
