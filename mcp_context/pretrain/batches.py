"""Which samples each step reads, and how a step's global batch is split over DP ranks and micro-batches.

The order depends only on the dataset (its seed) and the step number, never on the parallel layout:
step ``i`` reads samples ``[i * G, (i + 1) * G)`` of the megatron-core ``GPTDataset`` (``G`` =
``train.global_batch_size``); data-parallel rank ``d`` of ``dp`` takes the ``d``-th contiguous slice of
``G / dp`` samples, cut into micro-batches of ``train.micro_batch_size``. All CP ranks of one DP rank
read the same samples; the loop keeps each CP rank's zigzag shard (``slice_batch_for_cp``). So a run
resumed at another CP or DP size reads the same samples for the same step, and the global batch of
a step is the same at every layout.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset


class MicroBatchSampler:
    """Sample indices of one DP rank's micro-batches, step after step, for steps ``[first_step, last_step)``."""

    def __init__(self, first_step: int, last_step: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size * "
                             f"dp_size = {micro_batch_size} * {dp_size}")
        self.first_step, self.last_step = first_step, last_step
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.per_rank = global_batch_size // dp_size
        self.dp_rank = dp_rank

    @property
    def micro_batches_per_step(self) -> int:
        return self.per_rank // self.micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.first_step, self.last_step):
            start = step * self.global_batch_size + self.dp_rank * self.per_rank
            for first in range(start, start + self.per_rank, self.micro_batch_size):
                yield list(range(first, first + self.micro_batch_size))

    def __len__(self) -> int:
        return (self.last_step - self.first_step) * self.micro_batches_per_step


def step_batches(dataset: Dataset, sampler: MicroBatchSampler, num_workers: int = 0,
                 pin_memory: bool = False, packing: Optional[Callable[[dict], dict]] = None
                 ) -> Iterator[list[dict]]:
    """Yield, for each step of ``sampler``, the list of this DP rank's micro-batches (dicts of
    ``[micro_batch_size, seq_length]`` tensors: tokens, labels, loss_mask, position_ids[, attention_mask]),
    each passed through ``packing`` when given (``packing.DocumentPacking``: one packed sequence of
    documents); ``pin_memory`` for a run on CUDA."""
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory)
    micro_batches = iter(loader)
    for _ in range(sampler.first_step, sampler.last_step):
        step = [next(micro_batches) for _ in range(sampler.micro_batches_per_step)]
        yield step if packing is None else [packing(micro_batch) for micro_batch in step]
