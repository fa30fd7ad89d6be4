"""Work started when a model opens and waited for at its first use: the whole-layer plan's tiles.

Opening a model chooses its path at once, with the reason, but the repacks into tiles (C++ that
releases the GIL) need only be done before the first call that reads them. :class:`Pending` runs
them on a thread of their own, so the rest of the open (the vocabulary, the template), the chat's
banner and the user's typing go on beside them, and :meth:`Pending.wait` is the first use's join:

    work = Pending(build, "the tiles")   # started now
    ...                                  # the open returns; Python goes on
    work.wait()                          # the first call: waits for it, or raises what it raised

``wait`` is safe from any number of threads at once (each joins the same thread) and raises the
work's exception (its traceback kept) in every caller, every time, so a failed build never looks
built. The thread is not a daemon: a process interrupted while it runs exits once the work is done
(the repacks left), never in the middle of a C++ call.
"""

from __future__ import annotations

import threading
from typing import Callable


class Pending:
    """``work()`` running on its own thread from now; :meth:`wait` joins it (what: a name for errors)."""

    def __init__(self, work: Callable[[], object], what: str):
        self.what = what
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"tformer: {what}")
        self._thread.start()

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001  kept for the first use to raise, with its traceback
            self._error = e

    @property
    def done(self) -> bool:
        """Whether the work has finished (built or failed), without waiting."""
        return not self._thread.is_alive()

    @property
    def succeeded(self) -> bool:
        """Whether the work has finished without an exception, without waiting."""
        return self.done and self._error is None

    def wait(self) -> None:
        """Block until the work is done; raise its exception if it raised one (in every caller)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
