"""Reading host batches ahead of the device step."""

from __future__ import annotations

import queue
import threading


class prefetch:
    """Host batches read `depth` ahead on a background thread, so decoding and augmentation (log-mel,
    image crops, MLM masking) overlap the device step. The order is the iterator's: resumption and
    determinism are unchanged. An exception in the reader is raised in the loop; `close()` stops the
    thread (the loop calls it however it ends), so no reader outlives its run. depth 0 reads in the
    caller's thread."""

    def __init__(self, iterator, depth: int):
        self.iterator, self.depth = iterator, int(depth)
        self.queue: queue.Queue = queue.Queue(maxsize=max(self.depth, 1))
        self.stop = threading.Event()
        self.thread = None
        if self.depth > 0:
            self.thread = threading.Thread(target=self._read, name="favor-prefetch", daemon=True)
            self.thread.start()

    def _put(self, item) -> bool:
        # a bounded wait, so that close() stops a reader blocked on a full queue
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self):
        try:
            for item in self.iterator:
                if not self._put(item):
                    return
        except BaseException as e:         # handed to the loop, which raises it
            self._put(e)

    def __iter__(self):
        return self

    def __next__(self):
        if self.thread is None:
            return next(self.iterator)
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
