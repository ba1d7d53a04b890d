"""The synchronisation timings of lesson 19 (bench/parallel_regions.py): both loops run, and their arguments are
checked. Nothing here asserts a time (machines differ and are noisy); the lesson prints them."""

from __future__ import annotations

import math

import pytest
import torch

from llm_runtime.bench.parallel_regions import (SyncCosts, load_library, measure_sync_costs, stage_seconds,
                                                sync_costs_unavailable_reason)

pytestmark = pytest.mark.skipif(sync_costs_unavailable_reason() is not None,
                                reason=f"no C compiler here: {sync_costs_unavailable_reason()}")


def test_both_forms_of_a_step_run_and_give_a_time_per_stage() -> None:
    costs = measure_sync_costs(stages=200, repeats=2)
    assert isinstance(costs, SyncCosts) and costs.threads == torch.get_num_threads()
    for seconds in (costs.region_s, costs.barrier_s):
        assert math.isfinite(seconds) and 0 < seconds < 0.01


def test_stages_with_work_run_in_both_forms() -> None:
    library = load_library()
    for run in (library.stages_as_regions, library.stages_in_one_region):
        for items, work in ((1, 0), (2, 1000), (7, 10)):  # fewer items than threads, more, uneven
            assert 0 < run(10, items, work) < 10


@pytest.mark.parametrize("arguments", [dict(stages=0), dict(repeats=0), dict(work=-1)])
def test_bad_arguments_are_refused(arguments: dict) -> None:
    with pytest.raises(ValueError):
        stage_seconds(True, **arguments)
