"""The tools users run on runs and kernels: `favor-inspect` (python -m favor.tools.inspect: a run's attention
against softmax, layer by layer), `favor-report` (python -m favor.tools.report: a sweep's table and plots),
`favor-demo` (python -m favor.tools.demo: the kernels' estimates on one pair of inputs)."""
