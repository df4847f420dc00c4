"""benchmarks/spec_phases.py: its wrappers count what the engine ran and come off again."""

from __future__ import annotations

from benchmarks.spec_phases import restore, timed_phases
from deepinfer_core import LLM, SamplingParams
from deepinfer_core.sampling.sampler import SampledBatch


def test_phase_timers_count_the_mtp_steps_and_leave_the_engine_as_it_was():
    llm = LLM(accelerator="cpu", dtype="float32", progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    engine = llm.engine
    step, observe, resolve = engine.step, engine.proposer.observe, type(engine).__dict__["_resolve"]
    wait = SampledBatch.__dict__["resolve"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(["def f(x):\n"], params, use_tqdm=False)[0].outputs[0].token_ids
    totals, counts, undo = timed_phases(engine, synced=True)
    timed = llm.generate(["def f(x):\n"], params, use_tqdm=False)[0].outputs[0].token_ids
    restore(undo)
    assert timed == plain
    assert counts["step"] == counts["resolve"] == counts["mtp observe"] >= 2  # a prefill, then verifications
    assert counts["mtp forward"] >= counts["mtp observe"] and counts["token wait"] >= counts["step"]
    assert totals["step"] >= totals["resolve"] >= totals["mtp observe"] > 0
    assert engine.step == step and engine.proposer.observe == observe and "step" not in vars(engine)
    assert type(engine).__dict__["_resolve"] is resolve and "_resolve" not in vars(engine)
    assert SampledBatch.__dict__["resolve"] is wait
