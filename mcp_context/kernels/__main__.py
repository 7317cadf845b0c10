"""``python -m mcp_context.kernels``: which block kernel serves each dtype on this machine, and why
every other one does not. Attach its output to a bug report."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .base import FLOAT_DTYPES
from .registry import kernel_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mcp_context.kernels", description=__doc__)
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension the probes use (default 128)")
    ap.add_argument("--v-head-dim", type=int, default=None,
                    help="value head dim the probes use, if not --head-dim (MLA: e.g. --head-dim 192 --v-head-dim 128)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    for flag, value in (("--head-dim", args.head_dim), ("--v-head-dim", args.v_head_dim)):
        if value is not None and value < 1:
            print(f"error: {flag}={value} must be a positive integer, e.g. 128", file=sys.stderr)
            return 2
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    reports = [kernel_report(dev, dtype, args.head_dim, args.v_head_dim) for dev in devices for dtype in FLOAT_DTYPES]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                          "reports": reports}, indent=1))
        return 0
    gpu = f", {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})" if torch.cuda.is_available() else ", no GPU"
    dims = "" if args.v_head_dim in (None, args.head_dim) else f", v_head_dim {args.v_head_dim}"
    print(f"torch {torch.__version__}{gpu}; probes at head_dim {args.head_dim}{dims}")
    for rep in reports:
        print(f"\n{rep['device']} {rep['dtype']}: auto -> {rep['auto']}")
        for name, verdict in rep["backends"].items():
            print(f"  {name:16s} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
