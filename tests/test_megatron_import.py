"""Our commands import megatron-core with its jit fusions compiled at first call (``mcp_context.megatron_import``).

The stand-in for ``torch.compile`` compiles nothing when it decorates, compiles once at the first call with the
options it was given, binds as a method, and computes what the function computes; a process that imports
megatron-core through ``import_megatron_core`` loads neither dynamo nor inductor, and leaves ``torch.compile``
as it was.
"""
from __future__ import annotations

import subprocess
import sys

import torch

from mcp_context.megatron_import import compiled_at_first_call


def test_the_stand_in_compiles_at_the_first_call_once_with_its_options_and_binds_as_a_method():
    compiled = []

    def compile_(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *args: ("compiled", fn(*args))

    stand_in = compiled_at_first_call(compile_)

    @stand_in
    def double(x):
        """Twice x."""
        return 2 * x

    class Scaled:
        factor = 3

        @stand_in(dynamic=False)
        def scale(self, x):
            return self.factor * x

    assert compiled == [] and double.__name__ == "double" and double.__doc__ == "Twice x."
    assert double(4) == ("compiled", 8) and double(5) == ("compiled", 10)
    assert Scaled().scale(2) == ("compiled", 6)
    assert compiled == [("double", {}), ("scale", {"dynamic": False})]


def test_a_first_call_through_torch_compile_gives_the_functions_result():
    stand_in = compiled_at_first_call(torch.compile)
    swish = stand_in(lambda x: x * torch.sigmoid(x), backend="eager")
    x = torch.randn(16, dtype=torch.float64)
    assert torch.equal(swish(x), x * torch.sigmoid(x)) and torch.equal(swish(x + 1), (x + 1) * torch.sigmoid(x + 1))


def test_megatron_core_imports_without_dynamo_and_torch_compile_is_left_as_it_was():
    probe = ("import sys, torch; compile_ = torch.compile\n"
             "from mcp_context.megatron_import import import_megatron_core\n"
             "import_megatron_core()\n"
             "import megatron.core.models.gpt.gpt_model, megatron.core.jit as jit\n"
             "import mcp_context.megatron.specs, mcp_context.pretrain.loop\n"
             "print('torch._dynamo' in sys.modules, 'torch._inductor.compile_fx' in sys.modules, "
             "torch.compile is compile_, jit.jit_fuser is torch.compile)")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "False", "True", "False"], done.stdout
