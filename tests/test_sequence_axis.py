"""The sequence mesh axis (context parallelism, favor.attention.sequence) on simulated CPU devices:
attention over a sequence split across devices equals the unsplit call (outputs and gradients, each
path the axis takes, both modes, documents, padding, a window's band and a sign-indefinite kind's floor
crossing device boundaries); a decoder LM
trained with mesh.sequence=4 gives the losses of the same job data-parallel; bad layouts are one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the inputs both attention scripts start from: 8 devices as data 2 × sequence 4, and documents crossing
# the device boundaries at 16, 32 and 48; padding from 44
INPUTS = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from favor import attention
mesh = jax.make_mesh((2, 4), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
B, L, H, D = 2, 64, 2, 8
ks = jax.random.split(jax.random.key(0), 4)
q, k, v = (jax.random.normal(kk, (B, L, H, D)) for kk in ks[:3])
lin = jax.random.normal(ks[3], (B, L, H, D))
seg = np.zeros((B, L), np.int32); seg[0, 5:16] = 1; seg[0, 16:17] = 2; seg[0, 17:40] = 3; seg[0, 40:] = 4
seg[1, 30:] = 1
mask = np.ones((B, L), bool); mask[1, 44:] = False
"""

ATTENTION_SCRIPT = INPUTS + r"""
# one document of norms 6x the others
q0, k0 = q, k
q = q.at[0, 17:40].multiply(6.0); k = k.at[0, 17:40].multiply(6.0)
# one case per path the axis takes: exponential features (one span per device; several, with a window of
# 2 whose band and shifted keys cross the boundaries, and the learned mix), exact-zero features (ReLU: the
# exact log-space path), a learned map, softmax's gathered keys (and its band), and a sign-indefinite kind
# (trig, and with a window, whose floor counts the rounding mass off the band only: the floor's statistics
# are carried across devices; they are compared on their own below, with 8 features, where most rows'
# estimates fall below the floor, in each mode with and without documents and with a window's gap). Trig
# runs without the 6x document: its estimate there cancels to ~1e-4 of float32 rounding in any order of
# summation, split or not. Its programs over the axis are the suite's largest (a bidirectional one compiles
# for ~20 s): causal without a window and bidirectional with one (whose floor takes both directions' keys
# and the off-band mass) cover its paths
BOTH = (True, False)
cases = [("favor+", {}, BOTH), ("favor+", {"window": 2, "window_mix": "learned", "chunk_size": 4, "causal_span": 8},
                                BOTH),
         ("relu", {}, BOTH), ("hedgehog", {}, BOTH), ("favor", {"window": 2}, (False,)),
         ("softmax", {}, BOTH), ("softmax", {"window": 2}, BOTH), ("favor", {}, (True,))]
# two halves, one per process (the test's two parts run side by side); the second also checks the floor's
# statistics and the errors
part = int(sys.argv[1])
cases = cases[:5] if part == 0 else cases[5:]
out = {}
for name, opts, modes in cases:
    attn = attention.get(name, **opts)
    qq, kk = (q0, k0) if name == "favor" else (q, k)
    for causal in modes:
        # FAVOR+ with and without documents (one run per row is the fold's simplest input); every other case
        # with them (the floor's statistics are compared below in each mode with and without documents)
        for segs in ((None, seg) if name == "favor+" and not opts else (seg,)):
            f = lambda q, k, v: attn(q, k, v, mask=mask, causal=causal, rng=jax.random.key(1), segment_ids=segs)
            loss = lambda q, k, v: jnp.sum(f(q, k, v) * lin * mask[:, :, None, None])
            run = jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
            ref, ref_g = run(qq, kk, v)
            with jax.set_mesh(mesh):
                # compiled once: its result and its program's collectives
                run = jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
                run = run.lower(qq, kk, v).compile()
                got, got_g = run(qq, kk, v)
                hlo = run.as_text()
            m = mask[:, :, None, None]
            err = float(np.max(np.abs(np.asarray(got - ref) * m)) / np.max(np.abs(np.asarray(ref))))
            gerr = max(float(np.max(np.abs(np.asarray(a - b))) / np.max(np.abs(np.asarray(b))))
                       for a, b in zip(got_g, ref_g))
            key = f"{name}{opts} causal={causal} documents={segs is not None}"
            out[key] = {"out": err, "grad": gerr, "collective": ("all-gather" in hlo) or ("all-reduce" in hlo)}
# the sign-indefinite floor's statistics themselves (continuous, unlike the floored/plain branch a row takes
# at the bound): each device's, carried across the devices, against the unsplit floor
from favor.attention import documents, floor as floor_lib, sequence
from jax.sharding import PartitionSpec as P
attn = attention.get("favor", num_features=8)
x, y = attn.inputs(q, k)
vv = jnp.swapaxes(v, 1, 2)
floors = {}
# each mode with and without documents, and a window's gap (its off-band rounding mass) with documents
for causal, segs, gap in ([(c, s, 0) for c in (True, False) for s in (None, seg)] + [(c, seg, 3) for c in (True, False)]
                          if part else []):
    ctx = attn.context(q, k, mask, jax.random.key(1), None, None, None, None, causal)
    if True:
        runs = documents.runs(jnp.asarray(segs if segs is not None else np.zeros((B, L), np.int32)))
        def unsplit(x, y, v):
            norms = tuple(floor_lib.log_norm_bounds(*m(ctx, a)) for m, a in ((attn.query_map, x), (attn.key_map, y)))
            return floor_lib.jensen_floor(x, y, v, mask, causal, norms, None if segs is None else runs, gap)
        shard = lambda x, y, v, valid, runs: sequence._floor_shard(attn.query_map, attn.key_map, ctx, x, y, v, valid,
                                                                   runs, causal, 4, jax.lax.axis_index("sequence"),
                                                                   gap)
        rows = P(None, None, "sequence")
        split = lambda x, y, v: jax.shard_map(shard, mesh=mesh, in_specs=(rows, rows, rows, P(None, "sequence"),
                                                                          P(None, "sequence")),
                                              out_specs=rows, axis_names={"sequence"}, check_vma=False)(
            x, y, v, jnp.asarray(mask), runs)
        names = ("log", "mean", "low", "high", "log_mass")
        # a random linear functional of the finite statistics (the unsplit floor of one document per row
        # keeps whole-row sums as [B, 1, 1, ·]: broadcast to the rows)
        weights = {n: jax.random.normal(jax.random.key(i), getattr(jax.eval_shape(split, x, y, vv), n).shape)
                   for i, n in enumerate(names)}
        def total(floor):
            return sum(jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0) * weights[n])
                       for n in names for a in [jnp.broadcast_to(getattr(floor, n), weights[n].shape)])
        got, got_g = jax.jit(lambda x, y, v: (split(x, y, v), jax.grad(lambda *a: total(split(*a)), (0, 1, 2))(x, y, v)))(x, y, vv)
        want, want_g = jax.jit(lambda x, y, v: (unsplit(x, y, v), jax.grad(lambda *a: total(unsplit(*a)), (0, 1, 2))(x, y, v)))(x, y, vv)
        worst = 0.0
        for name in names:
            a, b = np.broadcast_arrays(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))
            assert np.array_equal(np.isfinite(a), np.isfinite(b)), name
            fin = np.isfinite(b)
            worst = max(worst, float(np.max(np.abs(a - b)[fin]) / max(np.max(np.abs(b[fin])), 1e-30)))
        grad = max(float(np.max(np.abs(np.asarray(a - b))) / np.max(np.abs(np.asarray(b)))) for a, b in zip(got_g, want_g))
        floors[f"causal={causal} documents={segs is not None} gap={gap}"] = (worst, grad)
errors = {}
with jax.set_mesh(mesh):
    for name, opts in ((("favor+", {"window": 16}),) if part else ()):
        try:
            jax.jit(lambda q: attention.get(name, **opts)(q, q, q, causal=True, rng=jax.random.key(1)))(q)
        except ValueError as e:
            errors[name + str(opts)] = str(e)
    try:
        if part:
            jax.jit(lambda q: attention.get("favor+")(q, q, q, causal=True, rng=jax.random.key(1)))(q[:, :30])
    except ValueError as e:
        errors["length"] = str(e)
# eager calls (outside jit) under the mesh: the unsplit results too
eager = {}
for name in (("softmax", "favor+") if part else ()):
    a = attention.get(name)
    ref = a(q, k, v, mask=mask, causal=True, rng=jax.random.key(1), segment_ids=seg)
    with jax.set_mesh(mesh):
        got = a(q, k, v, mask=mask, causal=True, rng=jax.random.key(1), segment_ids=seg)
    eager[name] = float(np.max(np.abs(np.asarray(got - ref)) * mask[:, :, None, None]) / np.max(np.abs(np.asarray(ref))))
print("RESULT" + json.dumps({"cases": out, "floors": floors, "errors": errors, "eager": eager}))
"""


def _run(script, devices, *args):
    from conftest import xla_flags
    env = dict(os.environ, XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


@pytest.mark.parametrize("part", [0, 1])
def test_attention_split_over_the_sequence_axis_equals_the_unsplit_call(part):
    result = _run(ATTENTION_SCRIPT, 8, str(part))
    assert result["cases"]
    for key, r in result["cases"].items():
        assert r["collective"], f"{key}: no collective in the program (the axis was not used)"
        # a sign-indefinite kind's sums cancel, which amplifies float32 rounding in any order of summation
        # (tests/test_documents.py's RTOL_SIGNED: 2e-4 of the ratio's condition, for the same reason)
        out_bound, grad_bound = (2e-4, 2e-4) if key.startswith("favor{") else (2e-5, 5e-5)
        assert r["out"] < out_bound, f"{key}: outputs off by {r['out']:.2e} relative"
        assert r["grad"] < grad_bound, f"{key}: gradients off by {r['grad']:.2e} relative"
    # the floor's statistics on their own: where a row's estimate sits at the floor's bound, float32 rounding
    # (not the same in the split and unsplit programs) picks the floored or the plain branch, which differ
    # there by the floor's rounding allowance, so rows at the bound are no measure of the statistics
    for key, (worst, grad) in result["floors"].items():
        assert worst < 1e-5, f"the floor's statistics split over the sequence axis, {key}: off by {worst:.2e}"
        assert grad < 5e-5, f"the floor's statistics' gradients split over the sequence axis, {key}: off by {grad:.2e}"
    if not part:
        return
    assert len(result["floors"]) == 6
    assert set(result["eager"]) == {"softmax", "favor+"}
    for name, err in result["eager"].items():
        assert err < 2e-5, f"{name} called eagerly over the sequence axis: off by {err:.2e} relative"
    errors = result["errors"]
    assert "window=16: the band crosses one device boundary at most" in errors["favor+{'window': 16}"]
    assert "mesh.sequence=4 must divide the sequence length; attention got L = 30" in errors["length"]


FUSED_SCRIPT = INPUTS + r"""
from favor.attention import fused, kinds, sequence, tpu
# "tpu": the kernels' backend replaced by a TPU, so each device runs the Mosaic document kernels (in TPU
# interpret mode on this CPU); the kernel's own result only (the fallback's choice is the backend's alike)
on_tpu = sys.argv[1] == "tpu"
if on_tpu:
    kinds.kernel_backend = lambda: "tpu"
    # TPU interpret mode runs the kernel through callbacks, which a shard_map takes only when every mesh axis
    # is manual: the sequence axis alone (4 devices, no data axis beside it)
    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
module = tpu if on_tpu else fused
passes = {"n": 0}
pass_ = module.document_pass
def counted(*a, **kw):
    passes["n"] += 1
    return pass_(*a, **kw)
module.document_pass = counted
shard = sequence._fused_shard
xla, kernel = attention.get("favor+", num_features=16), attention.get("favor+", num_features=16, impl="pallas")
out = {}
for scale, forced in ((2.0, True),) + (() if on_tpu else ((6.0, False),)):
    qs, ks_ = q.at[0, 17:40].multiply(scale), k.at[0, 17:40].multiply(scale)
    # forced: the kernel's result even where a key exceeds its chunk form (the inputs at 2x have none); at 6x
    # the fallback decides, the same on every device
    sequence._fused_shard = (lambda *a: (shard(*a)[0], jnp.asarray(False))) if forced else shard
    # the TPU's: causal only (the bidirectional composition around the pass is the backend's alike, and the
    # TPU pass with shifted key runs is tests/test_tpu_kernels.py's)
    for causal in ((True, False) if forced and not on_tpu else (True,)):
        f = lambda a: (lambda q, k, v: a(q, k, v, mask=mask, causal=causal, rng=jax.random.key(1), segment_ids=seg))
        both = lambda g: jax.jit(lambda q, k, v: (g(q, k, v), jax.grad(
            lambda *x: jnp.sum(g(*x) * lin * mask[:, :, None, None]), argnums=(0, 1, 2))(q, k, v)))
        ref, ref_g = both(f(xla))(qs, ks_, v)
        with jax.set_mesh(mesh):
            got, got_g = both(f(kernel))(qs, ks_, v)
        m = mask[:, :, None, None]
        err = float(np.max(np.abs(np.asarray(got - ref) * m)) / np.max(np.abs(np.asarray(ref))))
        gerr = max(float(np.max(np.abs(np.asarray(a - b))) / np.max(np.abs(np.asarray(b)))) for a, b in zip(got_g, ref_g))
        out[f"scale={scale} causal={causal}"] = {"out": err, "grad": gerr}
print("RESULT" + json.dumps({"cases": out, "passes": passes["n"]}))
"""


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_the_fused_kernel_runs_on_each_device_from_the_carry_of_the_others(backend):
    """impl='pallas' over the sequence axis: each device's fused document passes enter with the folded
    carry of the other devices' keys (bidirectional: and the reversed pass over keys crossing from the next
    device), equal to the unsplit XLA call in outputs and gradients, documents and padding crossing the
    boundaries; the kernel's result itself (forced past the fallback, no key exceeding it at these norms),
    and where a key exceeds the kernel's chunk form (a document at 6x) the XLA fallback, chosen the same way
    on every device. The Triton path's kernels, and the TPU's (the backend replaced, the Mosaic kernels in
    TPU interpret mode; causal, forced)."""
    result = _run(FUSED_SCRIPT, 8, backend)
    assert result["passes"] > 0, "the fused kernel was never traced"
    assert len(result["cases"]) == (1 if backend == "tpu" else 3)
    for key, r in result["cases"].items():
        assert r["out"] < 2e-5, f"{key}: outputs off by {r['out']:.2e} relative"
        assert r["grad"] < 5e-5, f"{key}: gradients off by {r['grad']:.2e} relative"


TRAIN_SCRIPT = r"""
import json, sys
sys.path.insert(0, ".")
from favor import job
from favor.attention import sequence
from configs import decoder_lm
out = {"split": 0}
plain = sequence.linear
def counted(*a, **k):      # how many attention layers were traced split over the sequence axis
    out["split"] += 1
    return plain(*a, **k)
sequence.linear = counted
for name, mesh in (("data4", {"data": 4, "sequence": 1}), ("sequence4", {"data": 1, "sequence": 4})):
    c = decoder_lm.get_config("runlocal,kind=favor+")
    c.total_steps, c.checkpoint_every, c.eval_every, c.log_every = 4, 100, 4, 1
    c.batch_size, c.eval_batch_size = 8, 8
    c.mesh = mesh
    s = job.run(c, sys.argv[1] + "/" + name)
    out[name] = [l for _, l in s["train_loss_history"]]
    out[name + "_eval"] = s.get("eval_history", [])
print("RESULT" + json.dumps(out))
"""


def test_a_decoder_trained_over_the_sequence_axis_matches_data_parallel(tmp_path):
    """mesh.data=1 mesh.sequence=4 against mesh.data=4 (packed documents, the decoder's default): the same
    losses, step by step."""
    result = _run(TRAIN_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path))), 4)
    assert len(result["data4"]) == 4 and result["split"] > 0
    for a, b in zip(result["sequence4"], result["data4"]):
        assert abs(a - b) <= 1e-5 * abs(b), (result["sequence4"], result["data4"])


def test_the_sequence_axis_spans_two_processes(tmp_path):
    """Two processes (jax.distributed, gloo) of 2 devices each, mesh.data=1 mesh.sequence=4: the sequence
    axis spans both, each process feeds the whole batch (its devices hold every row), and the run gives
    the single-process losses."""
    workdir = tmp_path / "two"
    from conftest import xla_flags
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    args = ["--config", "configs/decoder_lm.py:runlocal,kind=favor+", "--config.total_steps=3",
            "--config.eval_every=3", "--config.checkpoint_every=3", "--config.log_every=1",
            "--config.batch_size=8", "--config.eval_batch_size=8"]
    out = subprocess.run(["bash", str(ROOT / "launch/multihost_local.sh"), "2", str(workdir), *args,
                          "--config.mesh.data=1", "--config.mesh.sequence=4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    logs = "".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("two.process*.log")))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs
    two = json.loads((workdir / "summary.json").read_text())
    one = subprocess.run([sys.executable, "train.py", "--workdir", str(tmp_path / "one"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**env, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=1")})
    assert one.returncode == 0, one.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert two["step"] == one["step"] == 3 and len(two["train_loss_history"]) == 3
    for a, b in zip(two["train_loss_history"], one["train_loss_history"]):
        assert a[1] == pytest.approx(b[1], rel=1e-5), (two["train_loss_history"], one["train_loss_history"])


def test_the_context_bench_measures_memory_and_collectives(tmp_path):
    """`favor.bench context` on 2 simulated devices (it re-runs itself with the device flag): FAVOR+'s
    collectives do not grow with L and are below softmax's, which gathers the keys and values; the section,
    the raw figures and the plot are written."""
    from favor.bench import context
    hlo = ("%ag = f32[4,2,8]{2,1,0} all-gather(f32[1,2,8]{2,1,0} %x), dimensions={0}\n"
           "%ar = (f32[16]{0}, bf16[4,4]{1,0}) all-reduce(%a, %b), to_apply=%add\n"
           "%mul = f32[4,2,8]{2,1,0} multiply(%ag, %ag)\n")
    assert context.collective_bytes(hlo) == 4 * 64 + 4 * 16 + 2 * 16
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", "favor.bench", "context", "--lengths", "256,512", "--devices", "1,2",
                           "--time-devices", "2", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench" / "context-parallel.json").read_text())["rows"]
    at = {(r["kind"], r["length"], r["devices"]): r for r in rows}
    assert at[("favor+", 256, 1)]["collective"] == 0
    assert at[("favor+", 256, 2)]["collective"] == at[("favor+", 512, 2)]["collective"] > 0
    assert at[("softmax", 512, 2)]["collective"] > at[("softmax", 256, 2)]["collective"] > at[("favor+", 256, 2)]["collective"]
    assert at[("favor+", 512, 2)]["seconds"] is not None
    assert "## context-parallel" in (tmp_path / "BENCHMARKS.md").read_text()
    assert (tmp_path / "bench" / "context-parallel.png").stat().st_size > 10_000
