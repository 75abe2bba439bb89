"""A command run as a user runs it in a terminal: its own session, lines read as they come.

`CliProcess` starts the command in a new session (so everything it starts, Ray's processes
included, is found by session ID), collects stdout and stderr lines in a thread, waits for a
line, sends the terminal's Ctrl-C (SIGINT to the whole foreground process group) or SIGTERM,
and tells which of its processes are still alive. `close()` kills what is left, by session.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.ray_local import REPO_ROOT

TIMEOUT_EXIT_CODE = -999


class CliProcess:
    """One command in its own session; every line it prints is kept in `lines`."""

    def __init__(self, command: Sequence[str], env: dict[str, str], cwd: Path = REPO_ROOT):
        self.command = list(command)
        self.lines: list[str] = []
        self._new_lines: queue.Queue[str] = queue.Queue()
        self.process = subprocess.Popen(
            self.command,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.sid = self.process.pid
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new_lines.put(line)

    def wait_for_line(self, text: str, timeout_s: float) -> str:
        """The first line containing `text` (AssertionError with the output when it never came)."""
        deadline = time.monotonic() + timeout_s
        for line in self.lines:
            if text in line:
                return line
        while time.monotonic() < deadline:
            try:
                line = self._new_lines.get(timeout=min(1.0, deadline - time.monotonic()))
            except queue.Empty:
                if self.process.poll() is not None and self._new_lines.empty():
                    break
                continue
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout_s:g} s:\n{self.output()}")

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
        os.killpg(self.process.pid, signal.SIGINT)

    def terminate(self) -> None:
        """SIGTERM to the command's own process (as `kill PID`, systemd or Kubernetes do)."""
        self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        """(exit code, seconds it took); TIMEOUT_EXIT_CODE when still running after the timeout."""
        started = time.monotonic()
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = TIMEOUT_EXIT_CODE
        return code, time.monotonic() - started

    def alive_processes(self, grace_s: float = 5.0) -> list[str]:
        """Processes of the command's session still alive after `grace_s` (name and PID)."""
        deadline = time.monotonic() + grace_s
        alive = session_processes(self.sid)
        while alive and time.monotonic() < deadline:
            time.sleep(0.25)
            alive = session_processes(self.sid)
        return alive

    def output(self) -> str:
        return "\n".join(self.lines[-80:])

    def close(self) -> None:
        """Kill whatever of the session is left (after a failed test)."""
        for pid in session_pids(self.sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=30)


def session_pids(sid: int) -> list[int]:
    """PIDs of the live (not zombie) processes whose session ID is `sid` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            pids.append(int(entry.name))
    return pids


def session_processes(sid: int) -> list[str]:
    """`name[pid]` of each live process of session `sid`."""
    names = []
    for pid in session_pids(sid):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        names.append(f"{comm}[{pid}]")
    return names
