"""What every ``python -m minillm bench ...`` command shares: its common options and its tail (run,
print the table, write the record), so each benchmark module adds only its own options."""
from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from minillm.engine.device import add_threads_option, resolve_device
from minillm.engine.loader import TORCH_DTYPES
from minillm.lab import records


def add_options(cmd, model: str | None = None, dtype: str | None = "", out: str | None = "",
                threads: bool = True) -> None:
    """``--model`` (required when ``model`` is None, else its default), ``--device``, ``--dtype``
    (``dtype`` its default, "" the model's; None: no option), ``--out`` (``out`` an example path
    for the help; None: no option) and, with ``threads``, the thread policy's ``--threads``."""
    cmd.add_argument("--model", default=model, required=model is None,
                     help="preset name, .gguf file or directory with config.json"
                          + (f" (default {model})" if model else ""))
    cmd.add_argument("--device", help="cpu or cuda (default: $MINILLM_DEVICE, else CUDA if present)")
    if dtype is not None:
        cmd.add_argument("--dtype", default=dtype or None, choices=sorted(TORCH_DTYPES),
                         help=f"default: {dtype}" if dtype else "default: the model's on CUDA, float32 on the CPU")
    if out is not None:
        cmd.add_argument("--out", help="write the record to this JSON file" + (f", e.g. {out}" if out else ""))
    if threads:
        add_threads_option(cmd)


def report(args, kind: str, params: dict, run: Callable[[torch.device], dict], show: Callable[[dict], str]) -> int:
    """Run the benchmark on ``--device``, print ``show(result)`` and write the ``kind`` record with
    ``params`` (and the device) if ``--out``; a ``ValueError`` (bad settings, no such device) is
    printed as an error, exit code 2."""
    try:
        device = resolve_device(args.device)
        result = run(device)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(show(result))
    if getattr(args, "out", None):
        records.write(args.out, kind, {**params, "device": str(device)}, result, device)
        print(f"record written to {args.out}")
    return 0
