"""What one engine step has news of, for a front end that streams (``serving.drivers``) and for
a data-parallel group's serving step (``parallel.data_parallel``): ``Progress``."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_core.engine.output import RequestOutput, to_output


@dataclass
class Progress:
    """One step's news: ``ended`` requests (final outputs), ``partial`` outputs of unfinished
    requests that changed, and the failure that ended the step's requests, if any."""

    ended: list[RequestOutput] = field(default_factory=list)
    partial: list[RequestOutput] = field(default_factory=list)
    failure: str | None = None


def partial_output(engine, req) -> RequestOutput:
    """An unfinished request's output, its samples' text decoded so far. Text that may still
    change is held back: an incomplete UTF-8 character at the end, and the last characters a
    stop string could start with (the finished text is cut before the stop string)."""
    out = to_output(req, engine.proposer is not None)
    for c, seq in zip(out.outputs, req.seqs):
        if not seq.is_finished:
            text = engine.output.text_so_far(seq)
            hold = max(map(len, seq.params.stop)) - 1 if seq.params.stop and not seq.params.include_stop_str_in_output else 0
            c.text = text[: max(0, len(text) - hold)]
    return out


def step_progress(engine, finished: list, sent: dict[str, list[int]]) -> Progress:
    """The news after ``engine.step()`` returned ``finished``: their final outputs, and a partial
    output for every unfinished request whose token counts differ from ``sent`` (updated)."""
    spec = engine.proposer is not None
    progress = Progress(ended=[to_output(req, spec) for req in finished])
    for req in finished:
        sent.pop(req.request_id, None)
    for rid, req in engine.requests.items():
        counts = [len(s.output_token_ids) for s in req.seqs]
        if counts != sent.get(rid, []):
            sent[rid] = counts
            progress.partial.append(partial_output(engine, req))
    return progress
