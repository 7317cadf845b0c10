"""Pretrain from a recipe: ``torchrun --nproc-per-node 4 tools/pretrain.py --recipe recipes/tiny_cpu.yaml``.

Runs ``python -m mcp_context.pretrain`` from a source checkout (see that module for the options).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcp_context.pretrain.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
