"""Which device the engine runs on (all chapters): CUDA when present, else the CPU.

``MINILLM_DEVICE`` overrides the choice. Anything else is refused with a clear ``ValueError``
before a tensor is allocated. The thread policy lives here too: a command sets torch's CPU threads
once (``--threads``, default ``$OMP_NUM_THREADS`` when set, else one per physical core: a decode
step's matmuls split their rows over the cores, and SMT siblings share one core's units).
"""
from __future__ import annotations

import os

import torch


def pick_device() -> torch.device:
    """``$MINILLM_DEVICE`` if set, else CUDA when present, else the CPU."""
    requested = os.environ.get("MINILLM_DEVICE", "").strip()
    if not requested:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_device(requested, source="MINILLM_DEVICE")


def resolve_device(device: torch.device | str | None = None, source: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` this machine has (None: ``pick_device()``)."""
    if device is None:
        return pick_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{source}={str(device)!r} is not a torch device ({e})") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"{source} must be 'cpu' or 'cuda', got {str(device)!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{source}={str(device)!r} but CUDA is not available here")
    return resolved


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --- the thread policy ---------------------------------------------------------------------------

def physical_cores() -> int:
    """The physical cores this process may run on: SMT siblings (``thread_siblings_list``) count once."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:  # no sysfs (macOS, Windows): count logical CPUs
            cores.add(str(cpu))
    return len(cores)


def default_threads() -> tuple[int, str]:
    """(threads, why): ``$OMP_NUM_THREADS`` when set, else one per physical core."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "$OMP_NUM_THREADS"
    return physical_cores(), "one per physical core"


def set_threads(threads: int | None = None) -> str:
    """Set torch's CPU threads, once per process: ``threads``, or ``default_threads()``. Returns
    the line a command logs, e.g. ``"2 CPU threads (one per physical core)"``."""
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    threads, why = (threads, "--threads") if threads is not None else default_threads()
    torch.set_num_threads(threads)
    return f"{threads} CPU thread{'s' if threads > 1 else ''} ({why})"


def add_threads_option(cmd) -> None:
    """``--threads`` on a command: ``python -m minillm`` applies it with ``set_threads`` before running."""
    cmd.add_argument("--threads", type=int, help="torch's CPU threads (default: $OMP_NUM_THREADS if "
                                                 "set, else one per physical core)")
    cmd.set_defaults(thread_policy=True)
