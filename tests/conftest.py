"""Shared fixtures and the statistics every estimator test uses.

Tolerances are Z standard errors with Z = 5 and fixed seeds: deterministic, and a wrong formula
(a factor 2 in a variance, a missing weight) is many standard errors away.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# One persistent XLA compilation cache per test session, shared by the xdist workers (they inherit the
# controller's environment) and by the train.py / bench subprocesses the tests start: a program that
# several processes or tests build anew (every job.run re-jits its steps; each subprocess starts
# cold; both workers compile the same small eager ops) is compiled once. An executable is reused only
# for the identical program, devices and compile options (programs with host callbacks are never
# stored), so every test runs exactly the computation it ran before. The session's directory is
# removed at the end; an existing JAX_COMPILATION_CACHE_DIR is respected and left alone.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="favor-tests-xla-cache-")
    os.environ["FAVOR_TESTS_OWN_XLA_CACHE"] = str(os.getpid())
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"      # small eager ops add up too

# Tests compile thousands of small programs and run each briefly, so code generation is most of their time.
# The suite compiles at backend optimisation level 0 and with XLA:CPU's elemental fusion emitters in place
# of its MLIR fusion emitters: the whole suite on 2 cores took 9:56 with both and 15:06 with the first
# alone (the same machine, one after the other). The HLO (every operation, its order and its float32
# accumulation) is the same program users run; only the CPU machine code is made another way and less
# tuned (GPU and TPU use neither path). Exported, so train.py subprocesses inherit them; tests that set
# XLA_FLAGS themselves add to them (`xla_flags`); a flag XLA_FLAGS already sets keeps its value. Set
# FAVOR_TESTS_XLA_OPT=1 to run the suite with XLA's defaults.
TEST_XLA_FLAGS = () if os.environ.get("FAVOR_TESTS_XLA_OPT") else (
    "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
for _flag in TEST_XLA_FLAGS:
    if _flag.split("=")[0] + "=" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from favor import runtime  # noqa: E402
from favor.repro.sampling import repeated_estimates  # noqa: E402,F401  (the tests import it from here)

runtime.collect_less()      # as train.py does: the tests trace thousands of programs (favor/runtime.py says why)

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. An xdist worker compiles thousands of programs
    in one process and XLA:CPU keeps each one's machine code mapped; a long compile-heavy process here
    died of "LLVM ERROR: Unable to allocate section memory" (and segfaults inside compilation), the same
    native crashes that took down a worker in full runs. Modules share few programs, and the persistent
    cache above serves the ones they do."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _no_torch_in_test_processes(request):
    """No test process loads torch: its side runs in a subprocess (tests/hf_reference.py says why)."""
    yield
    assert "torch" not in sys.modules, (f"{request.module.__name__} loaded torch in a test process; run the "
                                        "torch side in a subprocess (tests/hf_reference.py)")


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory):
    """A directory of tiny random Hugging Face checkpoints, one per case of tests/hf_reference.py, each
    with the torch outputs on that file's inputs (reference.npz). Made by a process of its own: no test
    process loads torch (tests/hf_reference.py says why)."""
    out = tmp_path_factory.mktemp("hf_reference")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("hf_reference.py")), str(out)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"tests/hf_reference.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out


@pytest.fixture(scope="session")
def built_docstrings(tmp_path_factory):
    """A data directory holding the real docstring corpus (favor_docstrings), built once per test process
    (parsing the standard library is most of a build): copy it, never write into it."""
    from favor.data import local
    return Path(local.prepare("docstrings", tmp_path_factory.mktemp("favor_docstrings_built")))


def docstrings_copy(tmp_path_factory, built_docstrings):
    """A fresh data directory holding a copy of the docstring corpus and nothing else: what runs cache
    there (tokenizers included) stays the caller's own."""
    path = tmp_path_factory.mktemp("favor_data")
    shutil.copytree(built_docstrings, path, dirs_exist_ok=True)
    return path


@pytest.fixture(scope="module")
def docstrings_cache(tmp_path_factory, built_docstrings):
    """A `docstrings_copy` for the module, which FAVOR_DATA_DIR points at while the module runs."""
    path = docstrings_copy(tmp_path_factory, built_docstrings)
    mp = pytest.MonkeyPatch()
    mp.setenv("FAVOR_DATA_DIR", str(path))
    yield path
    mp.undo()


def xla_flags(*flags):
    """The environment's XLA_FLAGS (the suite's, above) with `flags` added: for subprocesses."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


# The longest tests, longest first (15–50 s each here: whole train.py runs, sweeps, subprocesses with 8
# devices), go first, so that the two xdist workers do not finish with one of them running alone while
# the other idles (the order of the rest is kept; each test still runs exactly as written).
LONGEST = ("test_attention_split_over_the_sequence_axis_equals_the_unsplit_call",
           "test_the_default_job_mqar_and_every_benchmark_run_without_tensorflow",
           "test_bench_accel_checks_times_and_writes", "test_a_llama_lora_run_resumes_and_folds_into_the_next_run",
           "test_sharded_layouts_on_8_devices_match_one_device",
           "test_sweep_runs_in_parallel_skips_finished_lists_failures_and_reports",
           "test_sigkill_during_transfer_resumes_to_the_same_result",
           "test_sigkill_then_rerun_resumes_and_matches_an_uninterrupted_run", "test_quick_run_writes_a_checked_report",
           "test_bench_attention_writes_table_and_json", "test_two_processes_match_one",
           "test_sign_indefinite_kinds_train_with_few_nonpositive_denominators",
           "test_bench_peers_times_favor_against_performer_pytorch", "test_runlocal_trains_softmax_and_the_bag_baseline",
           "test_causal_span_gradients_equal_those_of_the_explicit_form", "test_librispeech_runlocal_trains_and_reports_wer",
           "test_bench_steps_times_every_kinds_training_step",
           "test_the_fused_kernel_runs_on_each_device_from_the_carry_of_the_others",
           "test_the_context_bench_measures_memory_and_collectives")


# the tests `make test-quick` leaves out (`-m "not slow"`): chosen by tests/mark_slow.py from a measured run
SLOW = frozenset(line.strip() for line in Path(__file__).with_name("slow_tests.txt").read_text().splitlines()
                 if line.strip() and not line.startswith("#")) if Path(__file__).with_name("slow_tests.txt").exists() \
    else frozenset()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST)}                  # longest first
    items.sort(key=lambda item: rank.get(getattr(item, "originalname", item.name), len(LONGEST)))


def pytest_unconfigure(config):
    if os.environ.get("FAVOR_TESTS_OWN_XLA_CACHE") == str(os.getpid()):     # the process that made it
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


Z = 5.0


def pairs(d=6, seed=0, scale=0.35):
    """A few queries and keys with small norms, including x ≈ y and x ≈ −y pairs."""
    rng = np.random.default_rng(seed)
    x = scale * rng.standard_normal((4, d)) + 0.1
    y = scale * rng.standard_normal((3, d)) - 0.05
    y[0] = x[0] + 0.05 * rng.standard_normal(d)    # x ≈ y: trig is good here
    y[1] = -x[1] + 0.05 * rng.standard_normal(d)   # x ≈ −y: positive RFs are good here
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def assert_unbiased(est, exact, what):
    """Mean of R estimates within Z standard errors (empirical SE) of the exact kernel."""
    r = est.shape[0]
    mean = est.mean(0)
    se = est.std(0, ddof=1) / np.sqrt(r)
    z = np.abs(mean - exact) / se
    assert np.all(z < Z), f"{what}: biased? max |z| = {z.max():.2f}; mean {mean.ravel()[:4]} vs exact {exact.ravel()[:4]}"


def assert_variance_matches(est, analytic, what):
    """Sample variance within Z standard errors of the analytic variance; SE from the 4th moment."""
    r = est.shape[0]
    dev = est - est.mean(0)
    s2 = (dev ** 2).sum(0) / (r - 1)
    m4 = (dev ** 4).mean(0)
    se = np.sqrt(np.maximum(m4 - s2 ** 2, 1e-300) / r)
    z = np.abs(s2 - analytic) / se
    assert np.all(z < Z), (f"{what}: variance mismatch, max |z| = {z.max():.2f}; "
                           f"empirical {s2.ravel()[:4]} vs analytic {np.asarray(analytic).ravel()[:4]}")
    return s2


@pytest.fixture
def key():
    return jax.random.PRNGKey(0)
