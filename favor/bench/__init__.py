"""Benchmarks, one module per subcommand of `python -m favor.bench` (favor/bench/cli.py):

  attention  every kind, bidirectional and causal, against exact softmax and a same-FLOP matmul
  ratios     speed ratios against targets, every program timed round-robin
  parts      FAVOR+'s forward against the cost of its parts
  train      a train.py run: eval metric against wall-clock time
  steps      a config's training step for every kind, round-robin
  uptrain    every kind started from a softmax run (day 0, uptrained, attention transfer, scratch)
  peers      FAVOR+ against performer-pytorch (the optional `bench` extra)
  generate   a decoder's prefill and token-by-token decoding, each kind against softmax's cache
  accel      every kind (XLA and the fused kernel) against softmax/FlashAttention over lengths to 128K
  tune       the fused kernels' cut and launch (fused.TUNING): candidate cuts timed on this device
  lora       optimizer memory of LoRA uptraining against full fine-tuning
  context    long context over the sequence mesh axis: per-device memory, collectives and time, FAVOR+ and softmax
  headline   BENCHMARKS.md's table of targets, regenerated from the sections' raw figures (measures nothing)

Every figure of one run is also written as a ratio to figures measured in the same run (machines are
shared and noisy; ratios travel, seconds do not). Each subcommand writes its section of BENCHMARKS.md
(replaced between its markers) and bench/<section>.json through favor.bench.sections.
"""
