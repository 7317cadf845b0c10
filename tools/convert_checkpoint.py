#!/usr/bin/env python
"""Checkpoint conversion between Hugging Face Llama-family models and megatron-core (see docs/convert.md).

Thin wrapper around ``python -m mcp_context.convert``; run it with ``--help`` for the subcommands.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcp_context.convert.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
