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
one device. A window (favor.attention.window): the band reads the `window` nearest keys of the
neighbouring devices (a ppermute of those rows), and the estimate beyond it runs the same fold over keys
moved w + 1 positions, the rows crossing a boundary taken from the neighbour. The sign-indefinite kinds'
floor (favor.attention.floor) all-gathers each device's per-document reductions (sums, extremes, counts)
and folds them the same way. With impl='pallas' each device runs the fused kernel's document passes
(favor.attention.fused.document_pass) from the same folded carry. Softmax, the baseline: an all-gather of
the keys, values and their masks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from favor.attention import documents, fused as fused_lib, window as window_lib
from favor.attention.causal import CAUSAL_CHUNK
from favor.attention.floor import STAT_OPS, document_stats, floor_of, log_norm_bounds, ratio, whole_document
from favor.attention.linear import F32, NEG_INF, NO_RUN, combine, ones_column, segmented, sg

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


def _open_document(own, me, n, before):
    """Which devices' entries make up the document open where device `me` starts (before=True: the run of
    the previous device's last entry) or ends (before=False: the next device's), from `own` [n, B] (each
    device's entry's run): (use [n, B], that run [B], NO_RUN on the device with no such neighbour). Runs
    never decrease along the sequence, so the devices on that side whose entry has that run are exactly
    the ones the document spans: the nearest, and those before it wholly inside the document."""
    near = me - 1 if before else me + 1
    run = jnp.where((near >= 0) & (near < n), own[jnp.clip(near, 0, n - 1)], NO_RUN)
    side = jnp.arange(n) < me if before else jnp.arange(n) > me
    return side[:, None] & (own == run[None]), run


def _fold(carries, me, n, before):
    """The carry of the keys on the devices before `me` (before=True) or after it (before=False), from every
    device's carry of its last document in the pass's order (documents.summary: its run the last leaf),
    all-gathered: documents.merge of the entries of the document open there, one reduction over the devices
    (whose trace does not grow with their count)."""
    seen, tau, total, last = jax.lax.all_gather(carries, AXIS)
    use, run = _open_document(last, me, n, before)
    return (*documents.merge(seen, tau, total, use), run)


def _rows(flag, like):
    return flag.reshape(flag.shape + (1,) * (like.ndim - flag.ndim))


# a reduction over the device axis per STAT_OPS operator (the others reduce entry by entry)
_DEVICE_REDUCTIONS = {jnp.add: jnp.sum, jnp.minimum: jnp.min, jnp.maximum: jnp.max}


def _fold_stats(stats, own, me, n, before):
    """The floor's reductions (floor.STAT_OPS) over the keys of the document open where device `me` starts
    (before=True: on the devices before it; each device's entry its last document's) or where it ends
    (before=False: on the devices after it; each entry its first document's), `own` each entry's run, both
    all-gathered along a leading device axis -> (the reductions, that document's run [B])."""
    use, run = _open_document(own, me, n, before)
    carry = {}
    for name, a in stats.items():
        op, identity = STAT_OPS[name]
        used = jnp.where(_rows(use, a), a, identity)
        reduce = _DEVICE_REDUCTIONS.get(op)
        carry[name] = reduce(used, axis=0) if reduce else functools.reduce(op, list(used))
    return carry, run


def _floor_shard(query_map, key_map, ctx, x, y, v, valid, runs, causal, n, me, gap=0):
    """The sign-indefinite kinds' floor (floor.jensen_floor) of one device's queries over the keys of the
    whole sequence: the device's own reductions per document, plus the carried reductions of the document
    it starts inside (all-gathered, like the linear carry) and, bidirectional, of the one it ends inside.
    gap > 0 (a window's band of gap − 1): the rounding mass counts the keys off the band only."""
    w = valid[:, None, :, None].astype(F32)
    nq, nk = (sg(log_norm_bounds(*m(ctx, a)).astype(F32)) for m, a in ((query_map, x), (key_map, y)))
    nk = jnp.where(valid[:, None], nk, NEG_INF)
    stats = document_stats(y.astype(F32), v.astype(F32), w, runs, None if gap else nk)

    def add(stats, carried, run):
        inside = runs == run[:, None]                                       # [B, Lc]
        mask = lambda a: inside[:, None, :, None] if a.ndim == 4 else inside[:, None, :]
        return {name: jnp.where(mask(a), STAT_OPS[name][0](jnp.expand_dims(carried[name], 2), a), a)
                for name, a in stats.items()}

    ahead = jax.lax.all_gather(({k: a[:, :, -1] for k, a in stats.items()}, runs[:, -1]), AXIS)
    stats = add(stats, *_fold_stats(*ahead, me, n, before=True)) if causal else stats
    if not causal:
        whole = {name: whole_document(a, runs) for name, a in stats.items()}
        behind = jax.lax.all_gather(({k: a[:, :, 0] for k, a in whole.items()}, runs[:, 0]), AXIS)
        stats = add(add(whole, *_fold_stats(*ahead, me, n, before=True)), *_fold_stats(*behind, me, n, before=False))
    if gap:
        stats["mass"] = _off_band_mass(nk, runs, gap, causal, n, me)
    return floor_of(x.astype(F32), stats, nq)


def _off_band_mass(nk, runs, gap, causal, n, me):
    """log Σ_j ‖φ_k(j)‖ [B, H, Lc] over the keys of query i's document with j ≤ i − gap (and j ≥ i + gap
    when bidirectional) on every device: floor.estimated_mass over the split sequence, the keys moved gap
    positions as `_estimate` moves them and their running sums carried across devices."""
    def part(after):
        mk, mr = _moved(nk, gap, n, 2, NEG_INF, earlier=after), _moved(runs, gap, n, 1, NO_RUN, earlier=after)
        qr = runs
        if after:                   # the suffix sums: the same running reduction over the flipped rows
            mk, mr, qr = jnp.flip(mk, 2), jnp.flip(mr, 1), jnp.flip(runs, 1)
        total = segmented(mk, mr[:, None], jnp.logaddexp, NEG_INF, axis=2)
        # each device's entry: its running sum at its end in this direction, that end's document's run
        ends = jax.lax.all_gather(({"mass": total[:, :, -1]}, mr[:, -1]), AXIS)
        carried, crun = _fold_stats(*ends, me, n, before=not after)
        total = jnp.where((mr == crun[:, None])[:, None], jnp.logaddexp(carried["mass"][:, :, None], total), total)
        out = jnp.where((mr == qr)[:, None], total, NEG_INF)
        return jnp.flip(out, 2) if after else out

    mass = part(False)
    return mass if causal else jnp.logaddexp(mass, part(True))


def _neighbour(a, s, n, axis, fill, nxt):
    """s rows of the neighbouring device's `a` along the sequence: the previous device's last s (nxt=False)
    or the next device's first s (nxt=True); `fill` on the device that has no such neighbour."""
    l = a.shape[axis]
    rows = jax.lax.slice_in_dim(a, 0, s, axis=axis) if nxt else jax.lax.slice_in_dim(a, l - s, l, axis=axis)
    perm = [(i + 1, i) for i in range(n - 1)] if nxt else [(i, i + 1) for i in range(n - 1)]
    got = jax.lax.ppermute(rows, AXIS, perm)
    return jnp.where(jax.lax.axis_index(AXIS) == (n - 1 if nxt else 0), jnp.full_like(got, fill), got)


def _moved(a, s, n, axis, fill, earlier=False):
    """a moved s ≤ Lc positions later (earlier=True: earlier) along the whole sharded sequence: the rows
    that cross a device boundary come from the neighbour, `fill` enters at the sequence's end."""
    if s == 0:
        return a
    l = a.shape[axis]
    if earlier:
        return jnp.concatenate([jax.lax.slice_in_dim(a, s, l, axis=axis), _neighbour(a, s, n, axis, fill, True)], axis)
    return jnp.concatenate([_neighbour(a, s, n, axis, fill, False), jax.lax.slice_in_dim(a, 0, l - s, axis=axis)], axis)


def _estimate(query_map, key_map, ctx, x, y, v1, valid, runs, gap, n, after, chunk_size, path, span):
    """Σ φ_q(i)ᵀφ_k(j)[v_j, 1] over the keys j ≤ i − gap (after=True: j ≥ i + gap) of query i's document on
    every device: (out, log-scale) as documents.causal_sums gives them. The keys move `gap` positions (rows
    from the neighbouring device crossing over); each device reduces its moved keys to the carry of its
    last document, the carries are all-gathered and folded, and the device's own pass starts from the
    fold. after=True runs the reversed sequence (runs renumbered to stay non-decreasing)."""
    me = jax.lax.axis_index(AXIS)
    # no key where the sequence ends: NO_RUN in the pass's own numbering
    move = lambda a, axis, fill: _moved(a, gap, n, axis, fill, earlier=after)
    yk = jax.tree.map(lambda a: move(a, 2, 0.0), y)
    vk, validk = move(v1, 2, 0.0), move(valid, 1, False)
    rq, rk = runs, move(runs, 1, documents.RUN_TOP - NO_RUN if after else NO_RUN)
    if after:
        flip = lambda a: jnp.flip(a, axis=2)
        x, yk, vk = jax.tree.map(flip, x), jax.tree.map(flip, yk), flip(vk)
        validk = jnp.flip(validk, axis=1)
        rq, rk = documents.reversed_runs(rq), documents.reversed_runs(rk)
    lk, sk = key_map(ctx, yk)
    lk = jnp.where(validk[:, None, :, None], lk.astype(F32), NEG_INF)
    last = rk[:, -1]
    init = _fold(documents.summary(lk, sk, vk, rk == last[:, None], last), me, n, before=not after)
    out, scale = documents.causal_sums(query_map, key_map, ctx, x, yk, vk, validk, rq, rk, chunk_size, path, span,
                                       init)
    return (jnp.flip(out, axis=2), jnp.flip(scale, axis=2)) if after else (out, scale)


def _band(bx, by, v1, valid, runs, window, causal, n, log_mix):
    """The window's exact band of one device's queries: its keys with the neighbours' `window` nearest
    (the previous device's; bidirectional, the next one's too) -> (out, log-scale) as window.band_part."""
    right = 0 if causal else window
    l = bx.shape[2]

    def extended(a, axis, fill):
        parts = [_neighbour(a, window, n, axis, fill, False), a]
        return jnp.concatenate(parts + ([_neighbour(a, right, n, axis, fill, True)] if right else []), axis=axis)

    x = jnp.pad(bx, ((0, 0), (0, 0), (window, right), (0, 0)))
    keys = extended(valid, 1, False)
    has_key = jnp.broadcast_to(keys[:, None], (x.shape[0], x.shape[1], keys.shape[1]))
    out, m = window_lib.band_sums(x, extended(by, 2, 0.0), extended(v1, 2, 0.0), has_key, window, right,
                                  extended(runs, 1, NO_RUN))
    return window_lib.band_part((out[:, :, window:window + l], m[:, :, window:window + l]), log_mix)


def _fused_shard(forms, ctx, x, y, v, valid, runs, causal, n, precision, one_pass):
    """(out [B, H, Lc, Dv], exceeded [B, H, Lc]: the rows to take from the exact path, as fused.attend's) of
    the fused kernel's document passes (`one_pass`: fused.document_pass, or the TPU's) over one device's
    tokens, each entering with the carry of the other devices' keys: their log-features (forms(ctx, x, y):
    the kind's log-linear forms) reduced per device to its last document's state, all-gathered and folded
    as the XLA pass does; bidirectional adds the reversed pass over keys moved one position earlier,
    combined by the log-denominators."""
    me = jax.lax.axis_index(AXIS)
    (xq, rq, pq, cq), (xk, rk, pk, ck) = forms(ctx, x, y)
    pk, ck = sg(fused_lib.feature_params(pk, 2)), sg(fused_lib.feature_params(ck, 1))

    def carry(xk, rk, v, valid, krun, before):
        lk = jnp.matmul(xk.astype(F32), pk) + ck[:, :, None, :] + rk[..., None].astype(F32)
        lk = jnp.where(valid[:, None, :, None], lk, NEG_INF)
        last = krun[:, -1]
        return _fold(documents.summary(lk, None, ones_column(v), krun == last[:, None], last), me, n, before)

    def run(xq, rq, xk, rk, v, valid, qrun, krun, before):
        return one_pass(xq, rq, pq, cq, xk, rk, pk, ck, v, valid, qrun, krun, carry(xk, rk, v, valid, krun, before),
                        precision=precision)

    out, lden, exceeded = run(xq, rq, xk, rk, v, valid, runs, runs, True)
    if not causal:
        # keys j ≥ i + 1: moved one position earlier (the next device's first key crossing over), reversed
        move = lambda a, axis, fill: _moved(a, 1, n, axis, fill, earlier=True)
        flip = lambda a: jnp.flip(a, axis=2)
        keys = [flip(move(a, 2, 0.0)) for a in (xk, rk, v)]
        krun = documents.reversed_runs(move(runs, 1, documents.RUN_TOP - NO_RUN))
        back, lden_back, exceeded_back = run(flip(xq), flip(rq), *keys, jnp.flip(move(valid, 1, False), axis=1),
                                             documents.reversed_runs(runs), krun, False)
        out, _ = fused_lib.combine_blocks(jnp.stack([out, flip(back)], 2), jnp.stack([lden, flip(lden_back)], 2))
        exceeded = exceeded | flip(exceeded_back)
    return out, exceeded


def linear_shard(query_map, key_map, ctx, x, y, v, valid, runs, positive, causal, chunk_size, path, span, n,
                 window=0, band=None, log_mix=None, fused=None):
    """One device's share: x, y pytrees of [B, H, Lc, ·], v [B, H, Lc, Dv], valid [B, Lc] and runs [B, Lc]
    (the runs of the whole sequence: documents.runs before sharding) -> [B, H, Lc, Dv]. A sign-indefinite
    kind (not `positive`; x and y arrays, the kernel's inputs) gets its floor over the whole sequence.
    `window` > 0: the exact band (`band`: its inputs (x, y), `log_mix`: the learned mix) and the estimate
    beyond it, as favor.attention.window. `fused` {"forms", "precision", "pass"}: the fused kernel
    (`_fused_shard`; "pass" the backend's fused.document_pass), with this XLA pass's output in the rows past
    a key that exceeds the kernel's chunk form."""
    if fused is not None:
        out, exceeded = _fused_shard(fused["forms"], ctx, x, y, v, valid, runs, causal, n, fused["precision"],
                                     fused["pass"])
        xla = lambda: jnp.where(exceeded[..., None], linear_shard(
            query_map, key_map, ctx, x, y, v, valid, runs, positive, causal, chunk_size, path, span, n).astype(F32),
            out)
        # one decision for every device: the XLA pass's collectives need all of them in the same branch
        return jax.lax.cond(jax.lax.pmax(jnp.any(exceeded).astype(jnp.int32), AXIS) > 0, xla, lambda: out)
    me = jax.lax.axis_index(AXIS)
    v1 = ones_column(v)
    est = lambda gap, after: _estimate(query_map, key_map, ctx, x, y, v1, valid, runs, gap, n, after, chunk_size,
                                       path, span)
    gap = window + 1 if window else 0
    parts = [_band(*band, v1, valid, runs, window, causal, n, log_mix)] if window else []
    parts.append(est(gap, False))
    if not causal:
        parts.append(est(max(gap, 1), True))
    out, scale = combine(parts)
    floor = None if positive else _floor_shard(query_map, key_map, ctx, x, y, v, valid, runs, causal, n, me, gap)
    return ratio(out, positive, scale, floor)


def linear(query_map, key_map, ctx, x, y, v, valid, runs, positive, causal, chunk_size=CAUSAL_CHUNK, path="auto",
           span=None, window=0, band=None, log_mix=None, fused=None):
    """[B, H, L, Dv]: linear attention (causal or bidirectional, packed documents by `runs` or one per
    row; `window` > 0: the exact band of `band` = (x, y) inputs and the estimate beyond it; `fused`: the
    fused kernel, `linear_shard`) over x, y, v whose L is split over the sequence axis of the current mesh."""
    n = axis_size()
    b, h, l = v.shape[:3]
    check_length(l, n)
    if window and window + 1 > l // n:
        raise ValueError(f"window={window}: the band crosses one device boundary at most, so mesh.sequence={n} "
                         f"needs window + 1 ≤ L / {n} = {l // n} tokens per device")
    valid = jnp.ones((b, l), bool) if valid is None else jnp.asarray(valid, bool)
    runs = jnp.zeros((b, l), jnp.int32) if runs is None else runs
    seq = lambda a: P(None, None, AXIS)          # [B, H, L, ·]
    fn = lambda x, y, v, valid, runs, ctx, band, log_mix: linear_shard(
        query_map, key_map, ctx, x, y, v, valid, runs, positive, causal, chunk_size, path, span, n, window, band,
        log_mix, fused)
    mapped = jax.shard_map(fn, mesh=current_mesh(),
                           in_specs=(jax.tree.map(seq, x), jax.tree.map(seq, y), seq(v), P(None, AXIS),
                                     P(None, AXIS), jax.tree.map(lambda _: P(), ctx), jax.tree.map(seq, band),
                                     jax.tree.map(lambda _: P(), log_mix)),
                           out_specs=seq(v), axis_names={AXIS}, check_vma=False)
    # jitted: eager, a shard_map manual over some of the mesh's axes only refuses its own out_specs
    return jax.jit(mapped)(x, y, v, valid, runs, ctx, band, log_mix)


def softmax(q, k, v, mask, runs, causal, scale, window=0):
    """[B, L, H, Dv]: exact softmax with q, k, v [B, L, H, ·] split along L over the sequence axis, each
    device's queries against the keys and values all devices gathered (the baseline's communication:
    the whole K and V to every device); `window` > 0: the keys within `window` positions only."""
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
        rel = jnp.arange(l)[None, :] - (jax.lax.axis_index(AXIS) * lc + jnp.arange(lc))[:, None]     # j − i
        if causal:
            allowed = allowed & (rel <= 0)[None]
        if window:
            allowed = allowed & (jnp.abs(rel) <= window)[None]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32), k_all.astype(F32)) * scale
        logits = jnp.where(allowed[:, None], logits, NEG_INF)
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        w = jnp.where(allowed[:, None], jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        den = jnp.sum(w, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", w, v_all.astype(F32))
        den = jnp.where(den == 0, 1.0, den)                  # a query with no key outputs 0
        return (out / jnp.moveaxis(den, 1, 2)[..., None]).astype(v.dtype)

    row = P(None, AXIS)
    # jitted as `linear` is
    return jax.jit(jax.shard_map(shard, mesh=current_mesh(), in_specs=(row, row, row, row, row),
                                 out_specs=row, axis_names={AXIS}, check_vma=False))(q, k, v, mask, runs)
