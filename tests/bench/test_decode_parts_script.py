"""`litevlm bench --study decode_parts` as a user runs it: every variant's row at every context,
and the runtime left with every change on. Behaviour only: the figures themselves are the machine's."""

from __future__ import annotations

import os

import pytest

from litevlm_runtime.bench.studies import decode_parts
from litevlm_runtime.engines import torch_engine
from litevlm_runtime.errors import InputError
from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.models import decoder


@pytest.mark.skipif(not lowbit_kernels.load(), reason="low-bit CPU kernels not built here: nothing is stacked")
def test_every_variant_at_every_context_and_the_default_restored(capsys):
    follows_live, on_layer_ops = torch_engine.follows_live, decoder.on_layer_ops
    step_args = decoder.DecoderLayer.step_args
    cpus = os.sched_getaffinity(0)
    assert decode_parts.main(["--preset", "tiny-qwen3", "--threads", "1", "--context", "20,40",
                                   "--steps", "1", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("context ")) + 2
    rows = [line.split() for line in lines[first:] if line.strip()]
    assert [(r[0], " ".join(r[1:-7])) for r in rows] == [
        (c, v) for c in ("20", "40") for v in decode_parts.VARIANTS]
    n = len(decode_parts.VARIANTS)
    assert all(float(r[-1]) > 0 for r in rows) and [r[-1] for r in rows[::n]] == ["1.00", "1.00"]
    # the CPU columns: the calling thread's time is the process's at most (one thread: the helpers never start)
    assert all(0 < float(r[-5]) <= float(r[-4]) * 1.05 + 0.05 for r in rows)
    # one thread: no call is shared, so the caller never waits for a helper
    assert all(float(r[-3]) == 0.0 and r[-2] == "0%" for r in rows)
    assert torch_engine.follows_live is follows_live and decoder.on_layer_ops is on_layer_ops
    assert decoder.DecoderLayer.step_args is step_args
    assert os.sched_getaffinity(0) == cpus             # "on one CPU" frees the threads after its block


@pytest.mark.skipif(not lowbit_kernels.load(), reason="low-bit CPU kernels not built here: nothing is stacked")
def test_chosen_variants_in_the_tables_order_the_first_the_base(capsys):
    assert decode_parts.main(["--preset", "tiny-qwen3", "--threads", "1", "--context", "20", "--steps", "1",
                              "--rounds", "1", "--variants", "default,none"]) == 0
    out = capsys.readouterr().out
    assert "speed-up vs none" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("context ")) + 2
    rows = [line.split() for line in lines[first:] if line.strip()]
    assert [" ".join(r[1:-7]) for r in rows] == ["none", "all (the default)"] and rows[0][-1] == "1.00"


@pytest.mark.parametrize("spec, says", [("bogus", "matches no variant"), ("all but", "matches all but layer")])
def test_a_variant_that_names_none_or_several_is_refused_naming_them(spec, says):
    with pytest.raises(InputError, match=f"--variants {spec!r}: {says}"):
        decode_parts.main(["--preset", "tiny-qwen3", "--threads", "1", "--variants", spec])


def test_a_float_form_has_nothing_to_stack_and_says_so():
    with pytest.raises(InputError, match="--weights float: no projections stacked"):
        decode_parts.main(["--preset", "tiny-qwen3", "--weights", "float", "--threads", "1", "--rounds", "1"])


def test_holding_every_thread_to_the_callers_cpu_and_freeing_them():
    cpus = os.sched_getaffinity(0)
    here = decode_parts.current_cpu()
    assert here in cpus
    try:
        decode_parts.hold_threads({here})
        held = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
        assert held and all(v == {here} for v in held.values())
        assert decode_parts.current_cpu() == here
    finally:
        decode_parts.hold_threads(cpus)
    assert all(os.sched_getaffinity(int(t)) == cpus for t in os.listdir("/proc/self/task"))
