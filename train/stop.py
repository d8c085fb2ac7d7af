"""SIGTERM/SIGINT as a request to stop: the loop finishes its step, saves, and exits 128 + signal.

Under the `deepspeed` launcher on one node a SIGTERM reaches only the runner, so the ranks also
watch the runner and take its end as the signal.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil


class StopRequest:
    """Remembers the first SIGTERM/SIGINT so the loop can finish its step and save before exiting.

    Installed before any setup, so a signal during a long start (engine, resume) is not fatal.
    Repeats are ignored: launchers and schedulers often deliver the same request twice (to the
    process group and again through the launcher); SIGKILL aborts without saving.
    """

    def __init__(self) -> None:
        self.signum = 0
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)
        launcher = _deepspeed_runner()
        if launcher is not None:
            threading.Thread(target=self._watch, args=(launcher,), daemon=True).start()

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = self.signum or signum

    def _watch(self, launcher: psutil.Process) -> None:
        """The `deepspeed` runner has no signal handler on one node: SIGTERM ends it alone and its
        ranks would train on, unsaved. Its end is therefore taken as the SIGTERM it must have been."""
        while not self.signum:
            try:
                gone = not launcher.is_running() or launcher.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                gone = True
            if gone:
                self.signum = signal.SIGTERM
                return
            time.sleep(1.0)


def _deepspeed_runner() -> psutil.Process | None:
    """The `deepspeed` command that started this rank (runner -> deepspeed.launcher.launch -> rank), if any."""
    try:
        parent = psutil.Process().parent()
        runner = parent.parent() if parent is not None else None
        if parent is None or runner is None or "deepspeed.launcher.launch" not in parent.cmdline():
            return None
        args = runner.cmdline()[:3]
    except psutil.Error:
        return None
    if any(Path(arg).name == "deepspeed" or arg == "deepspeed.launcher.runner" for arg in args):
        return runner
    return None
