"""Running the checks, in order, on every CP rank (or in one process with ``--simulate``).

Order: the ranks' agreement first (nothing collective runs on a disagreement: a wrong plan would hang
or be silently wrong), the kernel per dtype, then per attention kind the engine against the reference
in each dtype and its bytes and time, then the model's boundaries, and for a dynamic-CP recipe one
step of documents over groups of every size (``dynamic``). Every check ends as one
``CheckResult`` that is the same on every rank: what needs the gathered data is computed on rank 0
and broadcast; an exception in a check fails that check (on every rank) and the run goes on.
"""
from __future__ import annotations

import sys
import traceback
import zlib
from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import first_line
from ..kernels import get_kernel
from . import boundaries, compare, plan
from .distributed import EngineRun, median_ms
from .exchange import engine_in_process, short_setup
from .faults import FAULTY_RANK
from .inprocess import ExchangeError
from .reference import document_ids, random_inputs, reference_attention
from .report import CheckResult
from .setup import AttentionKind, Setup, perturbed_documents
from .simulate import blocks_per_row, cp_schedule, kind_mask, simulate_attention


class Ranks:
    """The CP ranks a run spans: a process group, or (``group=None``) this one process playing all."""

    def __init__(self, group=None, progress: bool = True):
        self.group, self.progress = group, progress
        self.rank = 0 if group is None else dist.get_rank(group)
        self.size = 1 if group is None else dist.get_world_size(group)

    def gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        every: list = [None] * self.size
        dist.all_gather_object(every, obj, group=self.group)
        return every

    def from_rank0(self, fn: Callable[[], CheckResult], name: str) -> CheckResult:
        """``fn()`` on rank 0 (an exception becomes a failed check), the same result on every rank."""
        result = None
        if self.rank == 0:
            result = _guarded(fn, name)
        if self.group is None:
            return result
        box = [result]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def first_error(self, error: Optional[str]) -> Optional[str]:
        """The first rank's error (``"rank r: ..."``), the same on every rank, or None."""
        errors = self.gather(error)
        return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)

    def say(self, text: str) -> None:
        if self.progress and self.rank == 0:
            print(f"selftest: {text}", file=sys.stderr, flush=True)


def _guarded(fn: Callable[[], CheckResult], name: str) -> CheckResult:
    try:
        return fn()
    except Exception as err:  # a check that raises has failed; the others still run
        return CheckResult(name, False, first_line(err), {"error": traceback.format_exc(limit=3)})


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _rounded(data: dict, dtype: torch.dtype) -> dict:
    """The inputs rounded once to ``dtype`` (the sinks to fp32 for half precision), kept in fp64: the
    engine and the reference then see the same numbers."""
    sink_dtype = torch.float32 if dtype in compare.HALF else dtype
    return {name: None if x is None else x.to(sink_dtype if name == "sink" else dtype).double()
            for name, x in data.items()}


def agreement(setup: Setup, ranks: Ranks, fault: Optional[str], simulate: bool) -> CheckResult:
    """Every rank's ``Setup.fingerprint`` against rank 0's (simulated: the setup itself for every rank,
    a planted packing on ``FAULTY_RANK``)."""
    if simulate:  # one process plays every rank: a planted rank reads its own packing
        fingerprints = [setup.fingerprint()] * setup.cp_size
        if fault == "cu-seqlens-differ":
            fingerprints = list(fingerprints)
            fingerprints[FAULTY_RANK] = replace(setup, documents=perturbed_documents(setup.documents)).fingerprint()
    else:
        fingerprints = ranks.gather(setup.fingerprint())
    problems = plan.disagreements(fingerprints)
    fp = fingerprints[0]
    packing = f"{len(setup.documents[0]) - 1} documents" if fp["packing"] else "unpacked"
    summary = "; ".join(problems) or (f"{len(fingerprints)} ranks agree: CP {fp['cp_size']} {fp['sizes']} "
                                      f"{fp['comm']} {fp['layout']}, S={fp['seq_len']}, {packing}")
    return CheckResult("plan.agreement", not problems, summary, {"fingerprints": fingerprints})


def kernel_check(setup: Setup) -> list[CheckResult]:
    """The kernel ``auto`` picks per dtype, the backends that serve, and why each other one does not
    (the probe's reasons, first clause; all of them in the JSON)."""
    results = []
    for report in plan.kernels(setup):
        serving = [name for name, verdict in report["backends"].items() if verdict.startswith("serves")]
        reasons: dict[str, list[str]] = {}
        for backend, verdict in report["backends"].items():
            if backend not in serving:
                reason = verdict.split(";")[0]
                reason = reason if len(reason) <= 60 else reason[:57].rsplit(" ", 1)[0] + " ..."
                reasons.setdefault(reason, []).append(backend)
        refused = [f"{', '.join(names)}: {reason}" for reason, names in reasons.items()]
        summary = (f"auto -> {report['auto']} on {report['device']} (serve: {', '.join(serving)}"
                   + (f"; not: {'; '.join(refused)}" if refused else "") + ")")
        name = f"plan.kernel {dtype_name(getattr(torch, report['dtype']))}"
        results.append(CheckResult(name, True, summary, report))
    return results


def _attention_figures(setup: Setup, kind: AttentionKind, dtype: torch.dtype, rounded: dict, full: dict,
                       name: Optional[str] = None) -> CheckResult:
    """Rank 0: the gathered result against the reference on the same rounded inputs."""
    name = name or f"attention[{setup.kind_name(kind)}] {dtype_name(dtype)}"
    documents = document_ids(setup.seq_len, *setup.documents) if kind.packed else None
    on_device = {n: None if x is None else x.to(setup.device) for n, x in rounded.items()}  # fp64 there
    reference = {n: x.cpu() for n, x in reference_attention(
        on_device["q"], on_device["k"], on_device["v"], on_device["dout"], setup.head_dim ** -0.5, kind.window,
        documents, on_device["sink"]).items()}
    if dtype in compare.HALF:
        fused = simulate_attention(setup, kind, dtype, rounded, cp_size=1, inner=1, layout="zigzag")
        if "blocks" not in full:
            kernel = get_kernel("auto", torch.device(setup.device), dtype, head_dim=setup.head_dim,
                                v_head_dim=setup.v_head_dim)
            full["blocks"] = blocks_per_row(cp_schedule(setup, kind, kernel.capabilities.masks))
        figures = compare.half_precision_figures(full, fused, reference, dtype)
        shown = ", ".join(f"{n} {f['error']:.1e}/{f['bound']:.1e}"
                          + (f" ({f['ratio']:.2f}x fused)" if f["ratio"] is not None else "")
                          for n, f in figures.items())
    else:
        figures = compare.full_precision_figures(full, reference, dtype)
        worst = max(figures, key=lambda n: figures[n]["error"] / figures[n]["bound"])
        shown = (f"max error {max(f['error'] for f in figures.values()):.1e} "
                 f"(worst {worst}: {figures[worst]['error']:.1e} <= {figures[worst]['bound']:.1e})")
    bad = compare.failures(figures)
    return CheckResult(name, not bad, "; ".join(bad) if bad else shown, {"outputs": figures})


def exchange_check(setup: Setup, kind: AttentionKind, ranks: Ranks, fault: Optional[str]) -> CheckResult:
    """Every CP rank's engine as threads of this process (``exchange``: fp64, CPU, a short sequence): every
    transfer matched on both ends, and the gathered result against the fp64 reference. Distributed, each
    rank works this out itself and the ranks compare what they will send (a digest of every call and
    send) before any engine call; ``figures["transfers"]`` is False where transfers do not match (a real
    call would fail in the transport or hang)."""
    name = f"exchange[{setup.kind_name(kind)}]"
    short = short_setup(setup)
    log: list = []

    def run() -> CheckResult:
        data = _rounded(random_inputs(short.seq_len, short.batch, short.heads, short.kv_heads, short.head_dim,
                                      short.v_head_dim, short.seed, kind.softmax_type), torch.float64)
        try:
            full = engine_in_process(short, kind, data, fault, log)
        except ExchangeError as err:
            return CheckResult(name, False, f"transfers do not match: {err}", {"transfers": False})
        result = _attention_figures(short, kind, torch.float64, data, full, name)
        where = f"{short.cp_size} ranks as threads, S={short.seq_len} fp64: {len(log)} calls and sends matched"
        return replace(result, summary=f"{where}; {result.summary}", figures={**result.figures, "transfers": True})

    result = _guarded(run, name)
    if ranks.group is None:
        return result
    every = ranks.gather((result, zlib.crc32(repr(log).encode())))
    failed = next((r for r, (res, _) in enumerate(every) if not res.passed), None)
    if failed is not None:
        res = every[failed][0]
        return res if failed == 0 else replace(res, summary=f"rank {failed}: {res.summary}")
    differ = [r for r, (_, digest) in enumerate(every) if digest != every[0][1]]
    if differ:
        return CheckResult(name, False, f"ranks {differ} work out other transfers than rank 0 (their code or "
                           f"configuration differs): nothing is sent", {"transfers": False})
    return replace(result, summary=result.summary + f"; the same on all {ranks.size} ranks")


def attention_check(setup: Setup, kind: AttentionKind, dtype: torch.dtype, data: dict, ranks: Ranks,
                    groups, fault: Optional[str]) -> tuple[CheckResult, Optional[EngineRun], Optional[float]]:
    """The engine's forward and backward of ``kind`` in ``dtype`` against the fp64 reference; the run
    is returned for the bytes and time (None with ``--simulate`` or when the call failed), and with
    ``--simulate`` member 0's seconds."""
    name = f"attention[{setup.kind_name(kind)}] {dtype_name(dtype)}"
    rounded = _rounded(data, dtype)
    if groups is None:
        seconds = []

        def simulated() -> CheckResult:
            full = simulate_attention(setup, kind, dtype, rounded, fault, timed=dtype == setup.dtypes[0])
            seconds.append(full["seconds"])
            return _attention_figures(setup, kind, dtype, rounded, full)
        return ranks.from_rank0(simulated, name), None, (seconds[0] if seconds else None)
    error, local, run = None, None, None
    try:
        run = EngineRun(setup, kind, dtype, rounded, groups, fault)
        local = run.call()
    except Exception as err:  # the engine's own rank-agreement check raises on every rank alike
        error = first_line(err)
    error = ranks.first_error(error)
    if error is not None:
        return CheckResult(name, False, error), None, None
    full = run.gathered(local)
    return ranks.from_rank0(lambda: _attention_figures(setup, kind, dtype, rounded, full), name), run, None


def _mib(sent: dict[str, int]) -> str:
    """``"ring_kv 0.25 + ring_dkv 0.12 = 0.38 MiB"``: bytes by operation and in all."""
    parts = " + ".join(f"{op} {n / 2**20:.2f}" for op, n in sorted(sent.items()))
    return f"{parts} = {sum(sent.values()) / 2**20:.2f} MiB" if len(sent) > 1 else f"{parts} MiB"


def bytes_check(setup: Setup, kind: AttentionKind, dtype: torch.dtype, ranks: Ranks, run: Optional[EngineRun],
                seconds: Optional[float] = None) -> CheckResult:
    """Bytes per rank by operation against the analytic figure, and the time per call."""
    name = f"plan.bytes[{setup.kind_name(kind)}]"
    expected = plan.analytic_bytes(setup, dtype)
    if run is not None:
        sent, times = run.measure(setup.repeats)
        every = ranks.gather((sent, median_ms(times)))
        counted, ms = [s for s, _ in every], max(t for _, t in every)
        source = "trace, every rank"
    else:
        traced = plan.dry_run_bytes(setup, kind, kind_mask(kind, setup.seq_len, setup.documents), dtype)
        counted = [] if traced is None else [traced]
        ms = 1e3 * seconds if seconds is not None else float("nan")
        source = "planner dry run, rank 0"

    def verdict() -> CheckResult:
        problems = plan.bytes_verdict(kind, counted, expected)
        relation = "=" if plan.is_plain(kind) else "<="
        analytic = "the analytic figure" if counted and counted[0] == expected else f"analytic {_mib(expected)}"
        measured = f"rank 0 sent {_mib(counted[0])} ({source}) {relation} {analytic}" if counted else \
            f"{analytic} per rank (not measured: the dry run has one head dim)"
        summary = f"{measured}; {ms:.1f} ms per fwd+bwd call" + (" (member 0, one device)" if run is None else "")
        return CheckResult(name, not problems, "; ".join(problems) if problems else summary,
                           {"sent": counted, "analytic": expected, "ms_per_call": ms, "source": source})
    return ranks.from_rank0(verdict, name)


def boundary_checks(setup: Setup, ranks: Ranks, group) -> list[CheckResult]:
    packed = any(k.packed for k in setup.kinds)
    batch, params = boundaries.full_batch(setup, packed)
    slices = boundaries.slices_per_rank(setup, batch, params, group)
    shares = (boundaries.distributed_shares(slices[ranks.rank], group, torch.device(setup.device)) if group is not None
              else boundaries.simulated_shares(slices))

    def unslice() -> CheckResult:
        back = boundaries.unsliced(slices, params)
        bad = boundaries.check_unslice(batch, back)
        what = "packed " if packed else ""
        return CheckResult("boundaries.unslice", not bad, "; ".join(bad) or
                           f"{what}tokens, labels, loss mask, position ids back exactly ({setup.cp_size} slices)")

    def positions() -> CheckResult:
        bad = boundaries.check_positions(setup, boundaries.unsliced(slices, params), packed)
        n_docs = len(setup.documents[0]) - 1 if packed else 1
        return CheckResult("boundaries.positions", not bad, "; ".join(bad) or
                           (f"restart at 0 in each of {n_docs} documents" if packed else "0..S-1 in order"))

    def layout() -> CheckResult:
        bad = boundaries.check_layout(setup, batch, slices, packed)
        shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
        what = "per document, " if packed else "get_batch_on_this_cp_rank, "
        return CheckResult("boundaries.layout", not bad, shown or
                           f"{setup.cp_size} slices are megatron-core's ({what}RoPE) and zigzag's definition; "
                           f"layout {setup.layout} " + ("keeps its promises (S/P rows each, every row once)"
                                                        if setup.layout == "balanced" else "is its definition"),
                           {"problems": bad})

    def loss() -> CheckResult:
        bad, figures = boundaries.check_loss(shares, batch)
        return CheckResult("boundaries.loss", not bad, "; ".join(bad) or
                           f"CP mean {figures['cp_loss']:.12f} = full {figures['full_loss']:.12f} "
                           f"(|diff| {figures['error']:.1e})", figures)
    return [ranks.from_rank0(fn, name) for fn, name in ((unslice, "boundaries.unslice"),
                                                         (positions, "boundaries.positions"), (layout, "boundaries.layout"),
                                                         (loss, "boundaries.loss"))]


def run_checks(setup: Setup, ranks: Ranks, simulate: bool, fault: Optional[str] = None, layer: bool = True,
               allow_unchecked: bool = False) -> list[CheckResult]:
    """Every check, in order (``layer``: the one-layer check too). Distributed, ``ranks`` spans the
    world (the CP ranks) and the CP groups are built only once the ranks agree on the plan (groups of
    different sizes would hang). A layer this model's check cannot build is a row that did not run,
    which fails the run unless ``allow_unchecked``."""
    results = [agreement(setup, ranks, fault, simulate)]
    ranks.say(f"plan agreement: {'ok' if results[0].passed else 'FAILED'}")
    if not results[0].passed and not simulate:
        results.append(CheckResult("checks", False, "not run: the ranks disagree on the plan (see plan.agreement)"))
        return results
    groups = None
    if not simulate:
        from ..comm import build_hcp_groups

        groups = build_hcp_groups(list(setup.sizes))
    results += kernel_check(setup)
    unmatched = set()  # kinds whose transfers do not match: no engine call of theirs runs
    for kind in setup.kinds:
        data = random_inputs(setup.seq_len, setup.batch, setup.heads, setup.kv_heads, setup.head_dim,
                             setup.v_head_dim, setup.seed, kind.softmax_type)
        first_run, seconds = None, None
        ranks.say(f"exchange {setup.kind_name(kind)} (every rank in this process) ...")
        exchanged = exchange_check(setup, kind, ranks, fault)
        results.append(exchanged)
        ranks.say(f"  {exchanged.name}: {'pass' if exchanged.passed else 'FAIL'}")
        if not simulate and exchanged.figures.get("transfers") is False:
            unmatched.add(kind)
            results.append(CheckResult(f"attention[{setup.kind_name(kind)}]", False, f"not run: the transfers do "
                                       f"not match ({exchanged.name}); a real call would fail in the transport"))
            continue
        for i, dtype in enumerate(setup.dtypes):
            ranks.say(f"attention {setup.kind_name(kind)} {dtype_name(dtype)} ...")
            result, run, member_seconds = attention_check(setup, kind, dtype, data, ranks, groups, fault)
            results.append(result)
            if i == 0:
                first_run, seconds = run, member_seconds
            ranks.say(f"  {result.name}: {'pass' if result.passed else 'FAIL'}")
        if not simulate and first_run is None:
            continue  # the call failed: its error is the check's
        results.append(bytes_check(setup, kind, setup.dtypes[0], ranks, first_run, seconds))
    ranks.say("boundaries ...")
    results += _boundaries_guarded(setup, ranks, groups)
    if simulate or not layer:
        ranks.say("boundaries.layer: not run " + ("with --simulate (a layer at CP needs the CP ranks)" if simulate
                                                  else "(--skip-layer)"))
    else:
        for kind in setup.kinds:
            if kind in unmatched:
                results.append(CheckResult(f"boundaries.layer[{setup.kind_name(kind)}]", False, "not run: the "
                                           "transfers do not match (exchange); a real call would fail in the transport"))
                continue
            why = unchecked_layer(setup)
            if why is not None:
                results.append(CheckResult(f"boundaries.layer[{setup.kind_name(kind)}]", allow_unchecked,
                                           f"not run: {why}" + ("" if allow_unchecked else
                                                                "; pass --allow-unchecked to accept that"), ran=False))
                continue
            ranks.say(f"one layer {setup.kind_name(kind)} at CP {setup.cp_size} vs CP 1 ...")
            results.append(layer_check(setup, kind, ranks, groups, fault))
    if setup.dynamic_budget is not None:
        ranks.say(f"one dynamic-CP step over {setup.cp_size} ranks vs CP 1 ...")
        results.append(dynamic_check(setup, ranks, simulate, fault))
    return results


def unchecked_layer(setup: Setup) -> Optional[str]:
    """Why ``layer.layer_parity`` cannot build this model's layer (None: it can). It builds the recipe's
    layer (dense, MoE, MLA) or, from attention flags, a dense layer with one head dim."""
    if setup.model is None and setup.v_head_dim != setup.head_dim:
        return ("--v-head-dim without a recipe (the layer check builds an MLA layer from a recipe's "
                "multi_latent_attention; from flags, dense attention with one head dim)")
    return None


def layer_check(setup: Setup, kind: AttentionKind, ranks: Ranks, groups, fault: Optional[str] = None) -> CheckResult:
    """One transformer layer of the model at this CP against the same layer at CP = 1."""
    from .layer import layer_parity

    name = f"boundaries.layer[{setup.kind_name(kind)}]"
    error, figures = None, None
    try:
        figures = layer_parity(setup, kind, groups, setup.model, fault)
    except Exception as err:  # building or running the layer fails alike on every rank
        error = first_line(err)
    error = ranks.first_error(error)
    if error is not None:
        return CheckResult(name, False, error)

    def verdict() -> CheckResult:
        bad = [f"{n} error {e:.2e} > bound {b:.2e}" for n, (e, b) in figures.items() if not e <= b]
        grads = {n: v for n, v in figures.items() if n != "forward"}
        worst = max(grads, key=lambda n: grads[n][0] / grads[n][1])
        summary = (f"output {figures['forward'][0]:.1e} <= {figures['forward'][1]:.1e}; {len(grads)} parameter "
                   f"gradients, worst {worst} {grads[worst][0]:.1e} <= {grads[worst][1]:.1e} (fp32)")
        return CheckResult(name, not bad, "; ".join(bad) or summary,
                           {n: {"error": e, "bound": b} for n, (e, b) in figures.items()})
    return ranks.from_rank0(verdict, name)


def dynamic_check(setup: Setup, ranks: Ranks, simulate: bool, fault: Optional[str] = None) -> CheckResult:
    """One dynamic-CP step of the model (documents on groups of every size) against each document alone
    (``dynamic``): across the ranks, or with ``--simulate`` every rank a thread of this process."""
    from . import dynamic

    if simulate:
        def simulated() -> CheckResult:
            steps = dynamic.simulated_step(setup, fault)
            return dynamic.verdict(setup, steps[0], [step.left for step in steps])
        return ranks.from_rank0(simulated, dynamic.NAME)
    import megatron_patches

    error, step = None, None
    try:
        megatron_patches.apply_all(device=torch.device(setup.device))
        alone = [dist.new_group([r]) for r in range(ranks.size)][ranks.rank]
        step = dynamic.step_on_rank(setup, ranks.group, alone, fault)
    except Exception as err:  # a plan the ranks disagree on raises alike on every rank, before any collective
        error = first_line(err)
    error = ranks.first_error(error)
    if error is not None:
        return CheckResult(dynamic.NAME, False, error)
    lefts = ranks.gather(step.left)
    return ranks.from_rank0(lambda: dynamic.verdict(setup, step, lefts), dynamic.NAME)


def _boundaries_guarded(setup: Setup, ranks: Ranks, groups) -> list[CheckResult]:
    group = None if groups is None else groups.cp_group
    try:
        return boundary_checks(setup, ranks, group)
    except Exception as err:  # a slicing error raises alike on every rank
        return [CheckResult("boundaries", False, first_line(err), {"error": traceback.format_exc(limit=3)})]
