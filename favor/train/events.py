"""What a run reports while it trains: TensorBoard scalars and the progress of its steps.

The event files are written with tensorboard's own record format and scalar protos, not TensorFlow's
summary writer: importing TensorFlow costs every train.py process seconds of start-up, and clu's writers
and periodic actions import it whatever writer is asked for. TensorBoard, favor.tools.report and
TensorFlow's own readers read these files as they read TensorFlow's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2
from tensorboard.plugins.scalar import summary_v2
from tensorboard.summary.writer.record_writer import RecordWriter

log = logging.getLogger("favor.train")


class ScalarWriter:
    """Scalars of a run as TensorBoard events under `logdir` (one file per writer, TensorBoard's naming);
    `enabled=False` (the other processes of a multi-host run) writes nothing."""

    def __init__(self, logdir: str | Path, enabled: bool = True):
        self._records = None
        if not enabled:
            return
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # the pid and a nanosecond suffix keep two writers of one second and host apart (a resumed run)
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{time.time_ns() % 10**9}"
        self._records = RecordWriter(open(logdir / name, "wb"))
        self._write(event_pb2.Event(wall_time=now, file_version="brain.Event:2"))

    def _write(self, event):
        self._records.write(event.SerializeToString())

    def write_scalars(self, step: int, scalars: dict[str, float]):
        if self._records is None:
            return
        now = time.time()
        for tag, value in scalars.items():
            self._write(event_pb2.Event(wall_time=now, step=int(step), summary=summary_v2.scalar_pb(tag, float(value))))
        # on disk at once: TensorBoard and favor.tools.report read a run while it trains (a few writes a
        # logging step, so the flush costs nothing measurable)
        self._records.flush()

    def flush(self):
        if self._records is not None:
            self._records.flush()

    def close(self):
        if self._records is not None and not self._records.closed:
            self._records.close()


class Progress:
    """The rate of the steps between logging steps, called after every step with the steps done.

    At every `every_steps`-th step and the last one (never at the first call, whose step carries the
    compilation) it measures steps/s over the window since the previous report, writes `steps_per_sec`
    and `uptime` to the writer and keeps `steps_per_second` and `note` (progress, ETA and the share of
    time spent in each `timed` part) for the loop's log line."""

    def __init__(self, *, num_train_steps: int, every_steps: int, writer: ScalarWriter):
        self._total, self._every, self._writer = num_train_steps, max(int(every_steps), 1), writer
        self._t0 = time.monotonic()
        self._previous = None             # (step, time) of the previous report, or of the first call
        self._parts: dict[str, float] = {}
        self.steps_per_second = None
        self.note = ""

    def __call__(self, step: int) -> bool:
        t = time.monotonic()
        if self._previous is None:
            self._previous = (step, t)
            return False
        if step == self._previous[0] or (step % self._every and step != self._total):
            return False
        rate = (step - self._previous[0]) / max(t - self._previous[1], 1e-9)
        self._previous, self.steps_per_second = (step, t), rate
        elapsed = t - self._t0
        parts = "".join(f", {100 * s / elapsed:.0f}% {name}" for name, s in sorted(self._parts.items()))
        self.note = f"{100 * step / self._total:.0f}%, ETA {_duration((self._total - step) / rate)}{parts}"
        self._writer.write_scalars(step, {"steps_per_sec": rate, "uptime": elapsed})
        return True

    @contextlib.contextmanager
    def timed(self, name: str):
        """Counts the block's wall time as `name` (the block should end by fetching its results, so the
        time is the device's too)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self._parts[name] = self._parts.get(name, 0.0) + time.monotonic() - start


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
