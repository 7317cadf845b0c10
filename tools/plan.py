#!/usr/bin/env python
"""Context-parallel planner (see docs/performance.md).

Thin wrapper around ``python -m mcp_context.plan``; run it with ``--help`` for the flags.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcp_context.plan.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
