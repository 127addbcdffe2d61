"""favor's entry point for training jobs.

Until the training loop lands (issue 5: configs, sharded jit loop, orbax resume), `make train`
runs the kernel-estimation demo: every random-feature mechanism's relative MSE on a fixed
attention-like dataset (d = 64, M = 128), measured next to its analytic value.
"""

import sys

from favor import demo

if __name__ == "__main__":
    demo.main(sys.argv[1:])
