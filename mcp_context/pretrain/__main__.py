"""``python -m mcp_context.pretrain``: see ``mcp_context.pretrain.cli``."""
import sys

from mcp_context.pretrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
