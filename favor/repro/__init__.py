"""Reproductions of the papers' figures and tables, computed with favor's own kernel library.

    python -m favor.repro list
    python -m favor.repro <name> [--quick] [--out repro/<name>/] [options]

Each reproduction is a module here with NAME, SUMMARY, a PROTOCOL (its help text: the paper's setting
and where favor's differs), `add_arguments(parser)` and `run(args) -> report.Report`. The report is
written as <out>/<name>.png (the figure), <name>.md (the paper's numbers beside favor's) and
<name>.json (the raw figures). `--quick` runs a reduced protocol in seconds (the tests run it); the
full protocol is what the committed outputs under repro/ come from.
"""

from __future__ import annotations

from favor.registry import Registry

# name -> "module" (imported when named: each pulls in its own data and plotting)
REGISTRY = Registry("reproduction", {
    "crt-variance": "favor.repro.crt_variance",
    "crt-classify": "favor.repro.crt_classify",
    "simrf-mse": "favor.repro.simrf_mse",
    "simrf-classify": "favor.repro.simrf_classify",
    "hrf-pointwise": "favor.repro.hrf_pointwise",
    "favor-sharp-variance": "favor.repro.favor_sharp_variance",
    "importance-sampling": "favor.repro.importance_sampling",
    "listops-kernels": "favor.repro.listops_kernels",
    "speech-kernels": "favor.repro.speech_kernels",
    "mqar-kernels": "favor.repro.mqar_kernels",
    "uptrain-kernels": "favor.repro.uptrain_kernels",
    "linearize": "favor.repro.linearize",
})

names = REGISTRY.names
get = REGISTRY.lookup        # the reproduction's module; an unknown name is a ValueError listing the valid ones

