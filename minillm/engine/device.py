"""Which device the engine runs on (all chapters): CUDA when present, else the CPU.

``MINILLM_DEVICE`` overrides the choice. Anything else is refused with a clear ``ValueError``
before a tensor is allocated.
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
