"""Tokenise a recipe's corpus into megatron-core .bin/.idx files: ``python tools/prepare_data.py RECIPE``.

Runs ``python -m mcp_context.data`` from a source checkout (see that module for the options).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcp_context.data.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
