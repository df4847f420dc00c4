"""What a backend's hooks return, checked against the contract in ``hookspecs``.

pluggy checks a hook implementation's name and argument names; these check what it returns,
field by field, and that each op callable can be called the way the model calls the op (the
reference implementation's arguments positionally, its keyword-only ones by name), so a
plugin's mistake is reported at start-up, naming the plugin and the field or op, instead of
surfacing as an AttributeError or TypeError mid-run.
Each function returns the problems found as short phrases (an empty list: none).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from deepinfer_core.hookspecs import BackendInfo, OpPlan, ProbeResult, SchedulerLimits


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def _is_device(v: Any) -> bool:
    try:
        torch.device(v)
    except (TypeError, RuntimeError):
        return False
    return isinstance(v, str)


def _positive_or_none(v: Any) -> bool:
    return v is None or (_is_int(v) and v > 0)


def _field_problems(obj: Any, rules: dict[str, tuple[Callable[[Any], bool], str]]) -> list[str]:
    return [f"{type(obj).__name__}.{name} is {getattr(obj, name)!r}, expected {what}"
            for name, (ok, what) in rules.items() if not ok(getattr(obj, name))]


def _wrong_type(value: Any, expected: str) -> list[str]:
    return [f"it returned a {type(value).__name__} ({value!r:.60}), not {expected}"]


INFO_RULES = {
    "name": (_is_text, "a non-empty string"),
    "priority": (_is_int, "an int"),
    "min_spec_version": (_is_int, "an int"),
    "max_spec_version": (_is_int, "an int"),
    "aliases": (lambda v: isinstance(v, (tuple, list)) and all(_is_text(a) for a in v), "a tuple of non-empty strings"),
    "required_ops": (lambda v: isinstance(v, (set, frozenset, tuple, list)) and all(isinstance(o, str) for o in v),
                     "a frozenset of op names"),
    "description": (lambda v: isinstance(v, str), "a string"),
}
PROBE_RULES = {
    "available": (lambda v: isinstance(v, bool), "a bool"),
    "reason": (lambda v: isinstance(v, str), "a string"),
    "fix": (lambda v: isinstance(v, str), "a string"),
    "detail": (lambda v: isinstance(v, str), "a string"),
}
PLATFORM_RULES = {
    "name": (_is_text, "a non-empty string (it keys the platform's baselines)"),
    "device": (_is_device, "a torch device string such as 'cpu', 'cuda:0' or 'npu:0'"),
    "supported_dtypes": (lambda v: isinstance(v, (tuple, list)) and v and all(isinstance(d, torch.dtype) for d in v),
                         "a non-empty tuple of torch dtypes"),
    "fp8_weights": (lambda v: isinstance(v, bool), "a bool"),
    "fp4_experts": (lambda v: isinstance(v, bool), "a bool"),
    "graph_capture": (lambda v: isinstance(v, bool), "a bool"),
    "batch_invariant": (lambda v: isinstance(v, bool), "a bool"),
    "graphs": (lambda v: v is None or callable(v), "None or a callable returning a GraphBackend"),
    "async_scheduling": (lambda v: isinstance(v, bool), "a bool"),
    "extra": (lambda v: isinstance(v, dict), "a dict"),
}
LIMITS_RULES = {
    "max_num_batched_tokens": (_positive_or_none, "None or a positive int"),
    "max_num_seqs": (_positive_or_none, "None or a positive int"),
    "graph_batch_sizes": (lambda v: v is None or (isinstance(v, (tuple, list)) and all(_is_int(b) and b > 0 for b in v)
                                                  and list(v) == sorted(set(v))),
                          "None or a tuple of positive ints, ascending, without repeats"),
    "block_size": (_positive_or_none, "None or a positive int"),
}


def info_problems(info: Any, op_names: tuple[str, ...]) -> list[str]:
    if not isinstance(info, BackendInfo):
        return _wrong_type(info, "a BackendInfo")
    problems = _field_problems(info, INFO_RULES)
    unknown = sorted(set(info.required_ops) - set(op_names)) if not problems else []
    if unknown:
        problems.append(f"BackendInfo.required_ops names unknown ops {unknown}")
    return problems


def op_plan_problems(plan: Any, op_names: tuple[str, ...]) -> list[str]:
    if not isinstance(plan, OpPlan):
        return _wrong_type(plan, "an OpPlan")
    problems = []
    for field_name in ("provides", "left_out"):
        value = getattr(plan, field_name)
        if not isinstance(value, dict) or not all(isinstance(k, str) and _is_text(v) for k, v in value.items()):
            problems.append(f"OpPlan.{field_name} is {value!r:.60}, expected a dict of op names to non-empty strings")
    if problems:
        return problems
    unknown = sorted((set(plan.provides) | set(plan.left_out)) - set(op_names))
    if unknown:
        problems.append(f"OpPlan names unknown ops {unknown}")
    both = sorted(set(plan.provides) & set(plan.left_out))
    if both:
        problems.append(f"OpPlan both provides and leaves out {both}")
    return problems


def probe_problems(probe: Any) -> list[str]:
    if not isinstance(probe, ProbeResult):
        return _wrong_type(probe, "a ProbeResult")
    return _field_problems(probe, PROBE_RULES)


def platform_problems(platform: Any, backend_name: str) -> list[str]:
    from deepinfer_core.platform import Platform

    if not isinstance(platform, Platform):
        return _wrong_type(platform, "a deepinfer_core.platform.Platform")
    problems = _field_problems(platform, PLATFORM_RULES)
    if platform.backend != backend_name:
        problems.append(f"Platform.backend is {platform.backend!r}, expected the backend's own name {backend_name!r}")
    if not problems and platform.graph_capture and platform.graphs is None:
        problems.append("Platform.graph_capture is True but Platform.graphs is None: give the GraphBackend factory "
                        "that captures and replays graphs, or set graph_capture=False")
    return problems


def limits_problems(limits: Any) -> list[str]:
    if limits is None:
        return []
    if not isinstance(limits, SchedulerLimits):
        return _wrong_type(limits, "a SchedulerLimits or None")
    return _field_problems(limits, LIMITS_RULES)


def signature_problem(fn: Callable, contract: Callable) -> str | None:
    """Why ``fn`` cannot be called as the model calls the op whose reference is ``contract``:
    every positional argument by position, the keyword-only ones by name. None when it can, or
    when ``fn`` has no inspectable signature (a builtin). Names of positional arguments and
    defaults are the backend's own business."""
    try:
        have = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = list(inspect.signature(contract).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY}
    try:
        have.bind(*[None] * len(positional), **keyword)
    except TypeError as e:
        return f"takes {_plain(have)} but its contract is {contract.__name__}{_plain(inspect.signature(contract))}: {e}"
    return None


def _plain(sig: inspect.Signature) -> str:
    """A signature without annotations: "(x, weight, eps)"."""
    return str(sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty))
