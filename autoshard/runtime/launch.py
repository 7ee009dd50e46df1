"""``autoshard launch``: run N local processes of one program on ``jax.distributed``.

    autoshard launch --processes 2 --devices-per-process 4 -- python train.py --steps 3

Each process gets K simulated CPU devices and the variables that
``autoshard.runtime.distributed.initialize_from_env`` reads::

    XLA_FLAGS=--xla_force_host_platform_device_count=K   (any earlier count removed)
    JAX_PLATFORMS=cpu
    AUTOSHARD_COORDINATOR=127.0.0.1:PORT                 (a free loopback port)
    AUTOSHARD_NUM_PROCESSES=N  AUTOSHARD_PROCESS_ID=i

Output is streamed line by line with a ``[p<i>]`` prefix (stdout to stdout,
stderr to stderr); gloo's line per peer connection only with ``--verbose``.
When a process exits non-zero the others are stopped
(SIGTERM to their whole process group, SIGKILL after a grace period) and the
launcher exits with that process's code, after repeating the last lines of its
stderr. Nothing is left running: every child leads its own process group, which
is signalled as a whole (grandchildren included); SIGINT/SIGTERM/SIGHUP to the
launcher stop the children first; and should the launcher itself be SIGKILLed,
a small watchdog process, which sees the launcher's end of a pipe close, stops
the groups (each child also gets ``PR_SET_PDEATHSIG``). A grandchild that
leaves its process group (``setsid``) is beyond reach.

On a real cluster the scheduler starts the processes instead (one per host,
under SLURM, Kubernetes or a TPU slice); see docs/MULTIHOST.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

ENV_COORDINATOR = "AUTOSHARD_COORDINATOR"
ENV_NUM_PROCESSES = "AUTOSHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTOSHARD_PROCESS_ID"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
TIMEOUT_EXIT_CODE = 124
# gloo's line per peer connection (N x (N*K - 1) of them): forwarded only with --verbose
CHATTER = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def child_env(base: Mapping[str, str], *, process_id: int, processes: int, devices_per_process: int,
              coordinator: str) -> dict[str, str]:
    """The environment of process ``process_id``: ``base`` plus the launcher's variables."""
    env = dict(base)
    flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
    env["JAX_PLATFORMS"] = "cpu"
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(processes)
    env[ENV_PROCESS_ID] = str(process_id)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
    return env


# Runs beside the children in its own session, reading their process-group ids from a pipe whose
# write end only the launcher holds. EOF means the launcher is gone (even by SIGKILL, which it cannot
# catch): the watchdog then stops every group it was told about, grandchildren included.
_WATCHDOG = """
import os, signal, sys, time
groups = [int(line) for line in sys.stdin]
def signal_all(sig):
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
signal_all(signal.SIGTERM)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    alive = []
    for g in groups:
        try:
            os.killpg(g, 0)
            alive.append(g)
        except OSError:
            pass
    if not alive:
        break
    time.sleep(0.05)
signal_all(signal.SIGKILL)
"""


def _start_watchdog(grace_s: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(grace_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL this process when the launcher dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class _Child:
    index: int
    popen: subprocess.Popen[bytes]
    stderr_tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    open_streams: int = 2
    exited_at: float = 0.0  # monotonic time the launcher first saw a clean exit

    @property
    def pid(self) -> int:
        return self.popen.pid


def _pump(child: _Child, stream: IO[bytes], name: str, lines: queue.Queue[tuple[_Child, str, str | None]]) -> None:
    for raw in iter(stream.readline, b""):
        lines.put((child, name, raw.decode("utf-8", errors="replace").rstrip("\r\n")))
    stream.close()
    lines.put((child, name, None))


def _signal_group(child: _Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_all(children: Sequence[_Child], grace_s: float) -> None:
    """SIGTERM every child's process group, then SIGKILL whatever is left after ``grace_s``."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    # the leader may be gone while members of its group linger: kill the groups unconditionally
    for child in children:
        _signal_group(child, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=5.0)
    end = time.monotonic() + 5.0
    while any(_group_alive(c.pid) for c in children) and time.monotonic() < end:
        time.sleep(0.05)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into an exception so that the children are stopped first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise _Interrupted(signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch(argv: Sequence[str], processes: int, devices_per_process: int, port: int | None = None,
           timeout_s: float | None = None, *, grace_s: float = 5.0, env: Mapping[str, str] | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: bool = False) -> int:
    """Run ``argv`` as ``processes`` local processes of one jax.distributed job; return the exit code.

    ``verbose`` forwards every line, gloo's connection lines (``CHATTER``) included.

    0 when every process exits 0. Otherwise the first failing process's code
    (128+signal for a signal), ``TIMEOUT_EXIT_CODE`` when ``timeout_s`` passes,
    and 128+signal when the launcher itself is interrupted; the other processes
    are stopped in every case.
    """
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ValueError("nothing to launch: give the command after --, e.g. -- python train.py")
    if processes < 1 or devices_per_process < 1:
        raise ValueError(f"--processes and --devices-per-process must be positive, got {processes} "
                         f"and {devices_per_process}")
    out, err = stdout or sys.stdout, stderr or sys.stderr
    coordinator = f"127.0.0.1:{port or free_port()}"
    base = dict(os.environ if env is None else env)
    lines: queue.Queue[tuple[_Child, str, str | None]] = queue.Queue()
    children: list[_Child] = []
    failed: _Child | None = None
    code = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    watchdog = _start_watchdog(grace_s)
    assert watchdog.stdin is not None
    with _signals_raise():
        try:
            for i in range(processes):
                popen = subprocess.Popen(
                    argv, env=child_env(base, process_id=i, processes=processes,
                                        devices_per_process=devices_per_process, coordinator=coordinator),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, preexec_fn=_die_with_parent)
                child = _Child(i, popen)
                children.append(child)
                watchdog.stdin.write(f"{popen.pid}\n".encode())
                watchdog.stdin.flush()
                for stream, name in ((popen.stdout, "out"), (popen.stderr, "err")):
                    threading.Thread(target=_pump, args=(child, stream, name, lines), daemon=True).start()
            running = set(range(processes))
            while running:
                try:
                    child, name, text = lines.get(timeout=0.1)
                except queue.Empty:
                    pass
                else:
                    if text is None:
                        child.open_streams -= 1
                    else:
                        _forward(child, name, text, out, err, verbose)
                now = time.monotonic()
                for child in children:
                    if child.index not in running or child.popen.poll() is None:
                        continue
                    if child.popen.returncode != 0:
                        # stop at the first failure, without waiting for its streams to close
                        failed, code = child, _exit_code(child.popen.returncode)
                        break
                    # a clean exit is done once its output is drained (or a second later, when a
                    # grandchild it left behind holds the pipes open: stop_all ends that one)
                    child.exited_at = child.exited_at or now
                    if child.open_streams == 0 or now - child.exited_at > 1.0:
                        running.discard(child.index)
                if failed is not None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    code = TIMEOUT_EXIT_CODE
                    err.write(f"autoshard launch: timed out after {timeout_s:g} s; stopping all {processes} "
                              "processes\n")
                    break
        except _Interrupted as stop:
            code = 128 + stop.signum
            err.write(f"autoshard launch: got {stop}; stopping all {processes} processes\n")
        finally:
            stop_all(children, grace_s)
            with contextlib.suppress(OSError):
                watchdog.stdin.close()  # EOF: the watchdog finds the groups gone and exits
            _drain(lines, children, out, err, verbose)
            with contextlib.suppress(subprocess.TimeoutExpired):
                watchdog.wait(timeout=grace_s + 5.0)
    if failed is not None:
        tail = "\n".join(f"    {line}" for line in failed.stderr_tail) or "    (no stderr output)"
        err.write(f"autoshard launch: process {failed.index} (pid {failed.pid}) exited with code "
                  f"{failed.popen.returncode}; stopped the other {processes - 1}. "
                  f"Last lines of its stderr:\n{tail}\n")
        err.flush()
    return code


def _drain(lines: queue.Queue[tuple[_Child, str, str | None]], children: Sequence[_Child], out: IO[str],
           err: IO[str], verbose: bool) -> None:
    """Print what the stopped processes wrote last (the failing one's traceback, above all)."""
    end = time.monotonic() + 2.0
    while time.monotonic() < end and (any(c.open_streams for c in children) or not lines.empty()):
        try:
            child, name, text = lines.get(timeout=0.05)
        except queue.Empty:
            continue
        if text is None:
            child.open_streams -= 1
            continue
        _forward(child, name, text, out, err, verbose)
    out.flush()
    err.flush()


def _forward(child: _Child, name: str, text: str, out: IO[str], err: IO[str], verbose: bool) -> None:
    """One line of a child's output, prefixed with its index; gloo's per-peer connection lines only when
    ``verbose`` (CHATTER)."""
    if name == "err":
        child.stderr_tail.append(text)
    if not verbose and CHATTER.match(text):
        return
    sink = err if name == "err" else out
    sink.write(f"[p{child.index}] {text}\n")
    sink.flush()


def add_launch_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autoshard launch`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "launch", help="run a program as N local jax.distributed processes with K simulated CPU devices each",
        description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_launch_arguments(p)
    p.set_defaults(func=cmd_launch)
    return p


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", "-n", type=int, required=True, help="number of processes (N)")
    p.add_argument("--devices-per-process", "-k", type=int, default=1, help="simulated CPU devices per process (K)")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("--verbose", action="store_true", help="forward every line, gloo's connection lines too")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")


def cmd_launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("error: give the program after --, e.g. autoshard launch -n 2 -k 4 -- python train.py")
    return launch(command, args.processes, args.devices_per_process, port=args.port, timeout_s=args.timeout,
                  grace_s=args.grace, verbose=args.verbose)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard.runtime.launch", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    add_launch_arguments(parser)
    return cmd_launch(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

