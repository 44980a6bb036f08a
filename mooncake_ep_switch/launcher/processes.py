"""Facts about a rank's process: when it was created, and what its native threads wait in."""
import os
import shutil
import subprocess
import sys
import time
from typing import Optional

__all__ = ["process_created_at", "native_stacks"]


def process_created_at() -> float:
    """Wall-clock time (`time.time()`) this process was created, from /proc (10 ms resolution; the current time where /proc cannot tell)."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / ticks)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def native_stacks(rank: int, pid: Optional[int], timeout_s: float = 20.0) -> None:
    """Print every native thread's stack of a rank that does not answer to stderr (gdb, if installed)."""
    gdb = shutil.which("gdb")
    if gdb is None or pid is None:
        return
    try:
        found = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 24"],
                               capture_output=True, text=True, timeout=timeout_s)
        print(f"--- native stacks of rank {rank} (pid {pid}) ---\n{found.stdout[-60000:]}", file=sys.stderr)
    except (OSError, subprocess.SubprocessError) as error:
        print(f"--- no native stacks of rank {rank}: {error}", file=sys.stderr)
