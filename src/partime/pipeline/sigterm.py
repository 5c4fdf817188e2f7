"""SIGTERM while a process pipeline is open: an exception that closes it.

A program killed by SIGTERM's default action runs no ``finally`` and no ``__exit__``. Its stage
processes would still leave, each at its next wait, once they see their caller gone, and
multiprocessing's resource tracker would unlink the semaphores left behind (with a warning about
leaked objects); but nothing would be stopped and joined in order. So, while a pipeline of the
``process`` executor is open in the main thread, and only if SIGTERM still has its default
action, SIGTERM raises ``SystemExit(143)`` in the main thread (143 = 128 + 15, the status a shell
reports for a program SIGTERM ended): the pipeline closes as for any error, stopping and joining
every worker, and the program ends as it would have, unless it catches that exception.

The library takes no signal for good: a handler the program set itself is never replaced,
nothing is installed outside the main thread or while no pipeline is open, and closing the
pipeline restores the default action. SIGINT is left alone: its default already raises
``KeyboardInterrupt`` in the main thread, and the workers ignore it (the caller stops them). Where
no handler could be installed, or the caller is killed outright (SIGKILL), the workers' own check
that their caller is alive still ends them within ``waiting.POLL_S`` of their next wait.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_STATUS = 128 + signal.SIGTERM
"""What ``SystemExit`` carries when SIGTERM arrives while a pipeline is open."""


class SigtermGuard:
    """Turns SIGTERM into ``SystemExit(EXIT_STATUS)`` between ``install`` and ``restore``."""

    def __init__(self) -> None:
        self._installed = False

    def install(self) -> None:
        """Take SIGTERM if it has its default action and this is the main thread; else do nothing."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the program's own handler (or another open pipeline's) stays
        signal.signal(signal.SIGTERM, _raise_exit)
        self._installed = True

    def restore(self) -> None:
        """Give SIGTERM back its default action, if ``install`` took it and it is still ours."""
        installed, self._installed = self._installed, False
        if not installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _raise_exit:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the program at once
    raise SystemExit(EXIT_STATUS)
