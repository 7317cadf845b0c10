"""``python -m mcp_context.selftest``: does CP give the same numbers as no CP, here, for this model?

Run it on the cluster before a long job (``torchrun --nproc-per-node N -m mcp_context.selftest
--recipe R.yaml``), or with ``--simulate`` on one device. Checks, per distinct attention kind of the
model and per dtype, the engine's forward and backward against an fp64 reference on the gathered
sequence; the model's boundaries (batch slicing, positions, loss); and the plan (rank agreement,
kernel per dtype, bytes per rank, time per call); for a dynamic-CP recipe, one step of documents
spread over groups of every size against each document alone. See ``docs/selftest.md``.

Modules: ``setup`` (what is checked), ``reference`` (the fp64 reference), ``distributed`` (the engine
across ranks), ``simulate`` (every member on one device), ``inprocess`` (every rank a thread, the
transfers matched between them), ``exchange`` (the engine of every rank over ``inprocess``),
``compare`` (errors and bars), ``boundaries``, ``layout_truth`` (the layouts' definitions and
megatron-core's slicing), ``layer`` (one layer at CP against CP = 1), ``dynamic`` (a dynamic-CP step
against CP = 1), ``plan``, ``faults`` (test-only planted bugs), ``checks`` (running them), ``report``.
"""
