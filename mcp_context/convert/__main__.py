"""Command line: ``python -m mcp_context.convert {hf-to-mcore,mcore-to-hf,verify,make-random} ...``.

Owns argument parsing, turning bad arguments and conversion errors (bad or damaged input files,
unsupported models) into one line on stderr with exit status 2, and reporting peak memory. The work
itself is in ``converter``, ``verify`` and ``random_checkpoint``.
"""
from __future__ import annotations

import argparse
import math
import pickle
import re
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

from mcp_context.megatron_import import import_megatron_core

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"2GiB"`` -> 2 * 2**30, ``"1000"`` -> 1000 bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a byte count; write e.g. 5GB, 500MB or 2GiB")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    size = int(float(number) * base ** " KMGT".index(unit.upper() or " "))
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} is not positive; write e.g. 5GB, 500MB or 2GiB")
    return size


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0; write e.g. 1e-4")
    return value


class _UsageError(Exception):
    """A bad command line (argparse's message), reported in one line like every other error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the usage block and exit
        raise _UsageError(f"{self.prog}: {message} (see --help)")


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mcp_context.convert",
                description="Convert Llama-family checkpoints between Hugging Face safetensors and "
                            "megatron-core torch_dist.")
    sub = p.add_subparsers(dest="command", required=True)
    progress = _Parser(add_help=False)
    progress.add_argument("--no-progress", action="store_true", help="hide progress bars")

    a = sub.add_parser("hf-to-mcore", parents=[progress], help="HF safetensors -> megatron-core torch_dist")
    a.add_argument("--hf", required=True, type=Path, help="HF model directory (config.json + *.safetensors)")
    a.add_argument("--mcore", required=True, type=Path, help="output directory (must not exist)")

    b = sub.add_parser("mcore-to-hf", parents=[progress], help="megatron-core torch_dist -> HF safetensors")
    b.add_argument("--mcore", required=True, type=Path, help="megatron-core checkpoint directory")
    b.add_argument("--hf", required=True, type=Path, help="output directory (must not exist)")
    b.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest safetensors shard (default 5GB)")
    b.add_argument("--hf-config", type=Path, default=None,
                   help="HF config.json describing the model, for checkpoints not written by hf-to-mcore")

    v = sub.add_parser("verify", help="compare the logits of both sides on a prompt")
    v.add_argument("--hf", required=True, type=Path)
    v.add_argument("--mcore", required=True, type=Path)
    v.add_argument("--prompt", default=None, help="text (needs the tokenizer in --hf); default: 32 random ids")
    v.add_argument("--tolerance", type=_tolerance, default=1e-4, help="fail (exit 1) above this max |difference|")
    v.add_argument("--device", default="cpu",
                   help="where both models and their inputs run: cpu (default), cuda or cuda:N")

    r = sub.add_parser("make-random", help="write a random-weight HF checkpoint (for memory/speed measurements)")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--config", required=True, type=Path, help="HF config.json to instantiate")
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    r.add_argument("--max-shard-size", type=parse_size, default="5GB")
    return p


def _run(args: argparse.Namespace) -> int:
    from mcp_context.convert import converter
    from mcp_context.convert.hf_io import read_json_object

    show = False if getattr(args, "no_progress", False) else None
    if args.command == "hf-to-mcore":
        from mcp_context.convert.hf_quirks import ignored_fields

        arch = converter.hf_to_mcore(args.hf, args.mcore, progress=show)
        print(f"wrote {args.mcore} ({arch.model_type}, {arch.shape.num_layers} layers)")
        for quirk in ignored_fields(read_json_object(Path(args.hf) / "config.json", "a Hugging Face config.json")):
            print(f"notice: converted as config.json says, but {quirk}", file=sys.stderr)
    elif args.command == "mcore-to-hf":
        config = read_json_object(args.hf_config, "a Hugging Face config.json") if args.hf_config else None
        arch = converter.mcore_to_hf(args.mcore, args.hf, max_shard_bytes=args.max_shard_size,
                                     hf_config=config, progress=show)
        print(f"wrote {args.hf} ({arch.model_type}, {arch.shape.num_layers} layers)")
    elif args.command == "verify":
        from mcp_context.convert.hf_io import HFCheckpointReader
        from mcp_context.convert.hf_quirks import ignored_fields
        from mcp_context.convert.mcore_io import McoreCheckpointReader
        from mcp_context.convert.model_config import hf_model_from_config
        from mcp_context.convert.verify import (check_same_model, differing_tensors, max_logit_difference,
                                                prompt_token_ids, verify_device)

        device = verify_device(args.device)
        hf, mcore = HFCheckpointReader(args.hf), McoreCheckpointReader(args.mcore)
        arch = hf_model_from_config(hf.config)
        check_same_model(hf, mcore, arch)
        ids = prompt_token_ids(args.hf, args.prompt, arch.shape.vocab_size)
        diff = max_logit_difference(args.hf, args.mcore, arch.shape, ids, device)
        print(f"max |logit difference| = {diff:.3e} over {ids.shape[1]} tokens on {device} "
              f"(tolerance {args.tolerance:.1e})")
        if not diff <= args.tolerance:
            differ = differing_tensors(hf, mcore, arch)
            why = (f"{len(differ)} tensor(s) differ between --hf and --mcore, e.g. {differ[:4]} (the first in "
                   f"checkpoint order: {differ[0]})" if differ else
                   "every tensor is identical on both sides, so the models compute differently")
            quirks = ignored_fields(hf.config)  # the installed transformers' own departures from config.json
            print(f"verify: FAILED: {why}" + "".join(f"; {q}" for q in quirks), file=sys.stderr)
            return 1
    else:
        import torch

        from mcp_context.convert.random_checkpoint import write_random_hf_checkpoint

        nbytes = write_random_hf_checkpoint(args.out, read_json_object(args.config, "a Hugging Face config.json"),
                                            getattr(torch, args.dtype), max_shard_bytes=args.max_shard_size)
        print(f"wrote {args.out} ({nbytes / 2**30:.2f} GiB of weights)")
    return 0


def _error(exc: BaseException) -> int:
    print("error: " + " ".join(str(exc).split()), file=sys.stderr)  # one line, whatever the message holds
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        return _error(exc)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex) (are|is) not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import_megatron_core()  # before anything of megatron-core: its fusions compile at first call
    from mcp_context.convert.hf_io import MissingTensorError

    start = time.perf_counter()
    try:
        status = _run(args)
    except (MissingTensorError, ValueError, OSError, ImportError, pickle.UnpicklingError) as exc:
        return _error(exc)
    print(f"{args.command}: {time.perf_counter() - start:.1f} s, peak RSS {peak_rss_mib():.0f} MiB")
    return status


if __name__ == "__main__":
    sys.exit(main())
