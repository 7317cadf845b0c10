"""``python -m mcp_context.selftest``: check CP against no CP on this machine, for this model.

    torchrun --nproc-per-node 4 -m mcp_context.selftest --recipe recipes/tiny_cpu.yaml
    python -m mcp_context.selftest --simulate --recipe recipes/llama3_8b_128k.yaml --seq-len 2048

Prints a table on stdout (and every figure with ``--json PATH``), progress on stderr; the last line is
``selftest: N passed, M failed`` and the exit status is 0 only when every check passed (2: the
arguments or the launch are wrong).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..cp_rules import COMM_TYPES, LAYOUTS, PACKED_LAYOUTS, a2a_degree, check_heads, check_layout, check_levels, normalize_comm
from ..megatron_import import import_megatron_core
from .faults import FAULTS, check_fault
from .setup import DEFAULT_SEQ_LEN, SOFTMAX_TYPES, Setup, model_kinds, valid_seq_len, with_documents

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers, e.g. 2,2") from None


LIST_FLAGS = ("--hcp-sizes", "--window")
"""Flags whose value may start with a minus sign (``--window -1,0``, a mistyped ``--hcp-sizes -2,2``)."""


def _joined_lists(argv: Sequence[str]) -> list[str]:
    """``--hcp-sizes -2,2`` as ``--hcp-sizes=-2,2``: argparse reads a value that starts with ``-`` and is
    not a plain negative number as the next flag; joined, the value parses and is judged on its merits."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in LIST_FLAGS and re.fullmatch(r"-[0-9][0-9, -]*", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mcp_context.selftest", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=None, help="recipe YAML (recipes/*.yaml); dotted overrides follow")
    ap.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.window_size=[127,0]")
    model = ap.add_argument_group("attention flags (instead of, or over, a recipe)")
    model.add_argument("--heads", type=int, help="query heads per TP rank (default 8)")
    model.add_argument("--kv-heads", type=int, help="key/value heads per TP rank (default 2)")
    model.add_argument("--head-dim", type=int, help="query/key head dim (default 64)")
    model.add_argument("--v-head-dim", type=int, help="value head dim if not --head-dim (MLA, e.g. 192 / 128)")
    model.add_argument("--window", type=_ints, help="sliding window LEFT,RIGHT (e.g. 127,0)")
    model.add_argument("--window-attn-skip-freq", type=int,
                       help="every n-th layer attends in full (megatron-core's window_attn_skip_freq)")
    model.add_argument("--softmax-type", choices=SOFTMAX_TYPES, help="vanilla, off-by-one or learnable (sinks)")
    model.add_argument("--packed", action="store_true", help="packed documents (thd, a realistic length mix)")
    cp = ap.add_argument_group("context parallelism")
    cp.add_argument("--cp-size", type=int, help="CP ranks (default: the world size; 4 with --simulate)")
    cp.add_argument("--hcp-sizes", type=_ints, help="hierarchical CP sizes, inner first (e.g. 2,2)")
    cp.add_argument("--comm", choices=COMM_TYPES + ("allgather",), help="cp_comm_type (default a2a+p2p with "
                    "--hcp-sizes, else p2p)")
    cp.add_argument("--layout", default="zigzag", help="zigzag (Megatron), contiguous, striped; balanced (packed)")
    run = ap.add_argument_group("run")
    run.add_argument("--seq-len", type=int, help=f"test sequence length (default: the recipe's, at most "
                     f"{DEFAULT_SEQ_LEN['cpu']} on CPU, {DEFAULT_SEQ_LEN['cuda']} on a GPU)")
    run.add_argument("--batch", type=int, help="batch size (default: the recipe's micro batch, else 2; 1 packed)")
    run.add_argument("--dtype", type=lambda t: t.split(","), help="dtypes, e.g. fp64,fp32 (default: fp64,fp32 on "
                     "CPU; bf16 on a GPU)")
    run.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    run.add_argument("--simulate", action="store_true", help="every CP member's schedule in one process, one device")
    run.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--repeats", type=int, default=3, help="timed calls per attention kind (default 3)")
    run.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    run.add_argument("--skip-layer", action="store_true", help="skip the one-layer check (a large model's layer "
                     "on a CPU: two copies of its weights and gradients per rank)")
    run.add_argument("--allow-unchecked", action="store_true", help="accept checks that cannot run here (the "
                     "one-layer check of MLA head dims given by flags): listed as not run, exit 0 if the rest pass")
    run.add_argument("--plant", choices=sorted(FAULTS), help="TEST ONLY: plant a known CP bug so the self-test "
                     "must fail (tests/test_selftest.py); never on a real check")
    return ap


EXAMPLES = {"heads": 8, "kv_heads": 2, "head_dim": 64, "v_head_dim": 128, "cp_size": 4, "seq_len": 1024, "batch": 2,
            "repeats": 3}
"""The flags that must be positive integers, each with an example value for the message."""


def refuse_bad_flags(args: argparse.Namespace) -> None:
    """A ValueError naming the flag, its value and a fix for a flag that cannot run, before any work."""
    if args.recipe is not None and not os.path.isfile(args.recipe):
        raise ValueError(f"--recipe {args.recipe}: no such file; give the path of a recipe YAML, e.g. "
                         f"--recipe recipes/tiny_cpu.yaml")
    for name, example in EXAMPLES.items():
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be a positive integer, e.g. {example}")
    if args.hcp_sizes is not None and (not args.hcp_sizes or any(s < 1 for s in args.hcp_sizes)):
        raise ValueError(f"--hcp-sizes {','.join(map(str, args.hcp_sizes))} must be positive integers, inner "
                         f"level first, e.g. 2,2")
    if args.window_attn_skip_freq is not None and args.window_attn_skip_freq < 0:
        raise ValueError(f"--window-attn-skip-freq {args.window_attn_skip_freq} must be 0 or more (every n-th "
                         f"layer attends in full), e.g. 2")
    if args.window is not None and (len(args.window) != 2 or any(w < -1 for w in args.window)):
        raise ValueError(f"--window {','.join(map(str, args.window))} must be two integers LEFT,RIGHT, each -1 "
                         f"(unbounded) or more, e.g. 127,0")


def refuse_bad_heads(heads: int, kv_heads: int, comm: str, sizes: Sequence[int]) -> None:
    """Query heads that KV heads cannot serve evenly (GQA), or heads an all-to-all cannot split."""
    if heads % kv_heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= kv_heads]
        raise ValueError(f"--heads {heads} is not divisible by --kv-heads {kv_heads} (every KV head serves as many "
                         f"query heads); choose --kv-heads dividing {heads}, e.g. {divisors[-1]}")
    degree = a2a_degree(comm, sizes)
    if degree > 1:
        where = "the CP size" if degree == _product(sizes) else "the inner --hcp-sizes level"
        check_heads(heads, kv_heads, degree, comm, heads_name="--heads", kv_name="--kv-heads",
                    degree_name=f"the all-to-all degree ({where})")


def build_setup(args: argparse.Namespace, world_size: Optional[int]) -> Setup:
    """The setup from the recipe (if any) with the flags over it."""
    refuse_bad_flags(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    values = {"heads": 8, "kv_heads": 2, "head_dim": 64, "v_head_dim": None, "window": None, "skip": None, "softmax_type": "vanilla",
              "packed": False, "cp_size": None, "sizes": None, "comm": None, "seq_len": None, "batch": 2,
              "source": "flags", "half": torch.bfloat16, "model": None, "dynamic_budget": None}
    if args.recipe is not None or args.overrides:
        from ..plan.candidates import heads_per_tp_rank
        from ..recipes import load_recipe, validate_recipe

        cfg = load_recipe(args.recipe, args.overrides)
        validate_recipe(cfg)  # the recipe as a training run would take it (its own world size)
        m = cfg.model
        heads, kv = heads_per_tp_rank(m.num_attention_heads, m.num_query_groups or m.num_attention_heads,
                                      m.tensor_model_parallel_size)
        head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
        v_head_dim = head_dim
        if getattr(m, "multi_latent_attention", False):  # MLA: q/k carry the RoPE dims too
            head_dim, v_head_dim = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        # dynamic CP: its largest group is the whole data parallel world, which the fixed checks run over
        dynamic = m.hybrid_context_parallel
        values.update(heads=heads, kv_heads=kv, head_dim=head_dim, v_head_dim=v_head_dim,
                      softmax_type=getattr(m, "softmax_type", "vanilla"),
                      window=m.window_size, skip=m.window_attn_skip_freq, packed=cfg.data.reset_attention_mask,
                      cp_size=(world_size or cfg.train.world_size) if dynamic else m.context_parallel_size,
                      dynamic_budget=m.max_seqlen_per_dp_cp_rank if dynamic else None,
                      sizes=m.hierarchical_context_parallel_sizes,
                      comm=m.cp_comm_type, seq_len=m.seq_length, batch=cfg.train.micro_batch_size, source=cfg.name,
                      half=torch.float16 if m.params_dtype == "float16" else torch.bfloat16, model=m)
    flags = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
             "v_head_dim": args.v_head_dim, "window": args.window,
             "skip": args.window_attn_skip_freq, "softmax_type": args.softmax_type, "sizes": args.hcp_sizes,
             "comm": args.comm, "batch": args.batch}
    values.update({k: v for k, v in flags.items() if v is not None})
    values["packed"] = values["packed"] or args.packed
    if args.hcp_sizes is not None and args.cp_size is not None and _product(args.hcp_sizes) != args.cp_size:
        raise ValueError(f"--hcp-sizes {args.hcp_sizes} multiply to {_product(args.hcp_sizes)}, not --cp-size "
                         f"{args.cp_size}; give sizes whose product is {args.cp_size}")
    cp_size = (args.cp_size or (args.hcp_sizes and _product(args.hcp_sizes)) or values["cp_size"]
               or (4 if args.simulate else world_size))
    sizes = values["sizes"] if values["sizes"] and _product(values["sizes"]) == cp_size else [cp_size]
    comm = normalize_comm(values["comm"] or ("a2a+p2p" if len(sizes) > 1 else "p2p"))
    # upstream trains with no CP at all when a hierarchical scheme gets one level (Megatron-Bridge #2667)
    check_levels(comm, sizes, comm_name="cp_comm_type", sizes_name="hierarchical CP sizes",
                 fix=f"pass --hcp-sizes (e.g. 2,{cp_size // 2}) or set model.hierarchical_context_parallel_sizes")
    if cp_size < 2:
        raise ValueError(f"CP size {cp_size}: a self-test of context parallelism needs at least 2 CP ranks; launch "
                         f"with torchrun --nproc-per-node N (N >= 2) or pass --simulate --cp-size N")
    if not args.simulate and world_size != cp_size:
        layout = ("drop --cp-size (a dynamic-CP recipe's checks run over every launched rank)"
                  if values["dynamic_budget"] is not None else
                  f"set model.context_parallel_size={world_size} (with --cp-size {world_size} for flags)")
        raise ValueError(f"the world has {world_size} ranks but the CP size is {cp_size}: launch with torchrun "
                         f"--nproc-per-node {cp_size}, pass --simulate to check it on one device, or {layout}")
    refuse_bad_heads(values["heads"], values["kv_heads"], comm, sizes)
    if args.layout in PACKED_LAYOUTS and not values["packed"]:
        raise ValueError(f"--layout {args.layout} places the documents of a packed sequence: add --packed, or use "
                         f"one of {', '.join(LAYOUTS)}")
    check_layout(args.layout, packed=values["packed"])
    window = None if values["window"] is None else tuple(values["window"])
    kinds = model_kinds(window, values["skip"], values["softmax_type"], values["packed"])
    requested = args.seq_len or min(values["seq_len"] or DEFAULT_SEQ_LEN[device], DEFAULT_SEQ_LEN[device])
    seq_len = valid_seq_len(requested, cp_size, args.layout, values["packed"])
    dtypes = args.dtype or (["bf16"] if device == "cuda" and values["half"] == torch.bfloat16 else
                            ["fp16"] if device == "cuda" else ["fp64", "fp32"])
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"--dtype {','.join(unknown)}: choose from {', '.join(DTYPES)}")
    setup = Setup(cp_size, tuple(sizes), comm, args.layout, seq_len, values["batch"], values["heads"],
                  values["kv_heads"], values["head_dim"], values["v_head_dim"] or values["head_dim"], kinds,
                  tuple(DTYPES[d] for d in dtypes), device, args.seed, args.repeats, values["source"],
                  model=values["model"], dynamic_budget=values["dynamic_budget"])
    return with_documents(replace(setup, batch=1) if values["packed"] else setup)


def _product(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _init_distributed(device: str) -> bool:
    """Join torchrun's world (gloo on CPU, NCCL on GPUs); True when this call created the group."""
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ:
        return False
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return True


def describe(setup: Setup, simulate: bool) -> str:
    mode = "simulated on one device" if simulate else f"{setup.cp_size} ranks"
    kinds = ", ".join(setup.kind_name(k) for k in setup.kinds)
    return (f"selftest of {setup.source}: CP {setup.cp_size} {list(setup.sizes)} {setup.comm} {setup.layout}, "
            f"{mode}, {setup.device}; S={setup.seq_len} b={setup.batch} heads {setup.heads}/{setup.kv_heads} "
            f"head dim {setup.head_dim}" + (f"/{setup.v_head_dim}" if setup.v_head_dim != setup.head_dim else "")
            + f"; kinds: {kinds}" + (f"; dynamic CP over the {setup.cp_size} ranks, at most {setup.dynamic_budget} "
                                     f"tokens a rank" if setup.dynamic_budget is not None else ""))


def main(argv: Optional[Sequence[str]] = None) -> int:
    import_megatron_core()  # before anything of megatron-core: its fusions compile at first call
    from . import report
    from .checks import Ranks, run_checks

    args = _parser().parse_intermixed_args(_joined_lists(sys.argv[1:] if argv is None else argv))
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device here; use --device cpu (gloo)", file=sys.stderr)
        return 2
    created = False if args.simulate else _init_distributed(device)
    try:
        world = dist.get_world_size() if dist.is_initialized() and not args.simulate else None
        try:
            if world is None and not args.simulate:
                raise ValueError("no process group: launch with torchrun --nproc-per-node N -m mcp_context.selftest "
                                 "..., or pass --simulate to run every CP member on this one device")
            setup = build_setup(args, world)
            check_fault(args.plant, any(k.sink for k in setup.kinds), any(k.packed for k in setup.kinds),
                        setup.dynamic_budget is not None)
            if args.plant == "cu-seqlens-differ" and not args.simulate and dist.get_rank() == 1:
                from .setup import perturbed_documents

                setup = replace(setup, documents=perturbed_documents(setup.documents))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        ranks = Ranks(None if args.simulate else dist.group.WORLD, progress=not args.no_progress)
        ranks.say(describe(setup, args.simulate))
        results = run_checks(setup, ranks, args.simulate, args.plant, layer=not args.skip_layer,
                             allow_unchecked=args.allow_unchecked)
        if ranks.rank == 0:
            print(describe(setup, args.simulate))
            print(report.table(results))
            if args.json:
                report.write_json(args.json, {"setup": setup.fingerprint(), "device": setup.device,
                                              "simulate": args.simulate, "torch": torch.__version__,
                                              "planted": args.plant}, results)
            print(report.summary_line(results), flush=True)
        return 0 if all(r.passed for r in results) else 1
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
