"""End-to-end conformance: per-sample perplexity and greedy tokens against recorded baselines.

A workload (``specs/workloads/<name>.toml``, see the README there) names a checkpoint of
``conformance.checkpoints``, a compute dtype, a prompt set and a number of greedy tokens. For
every sample of it the run measures, in one ``LLM.generate`` call per workload:

* ``ppl``: the perplexity of the sample's fixed continuation under teacher forcing, exp(-mean
  logprob) of the continuation's tokens, from the prompt logprobs of prompt + continuation run
  as one prompt (prompt tokenised with BOS, continuation without, the ids concatenated);
* ``greedy_tokens``: the first ``max_tokens`` greedy tokens after the prompt (EOS ignored);
* ``greedy_logprobs``: the logprob of each greedy token as the step that chose it computed it
  (the first from the prompt's prefill, the others from decode steps over the paged cache).
  Where the greedy tokens agree with the baseline's, the decode steps were fed exactly the
  baseline's tokens, so these are teacher-forced decode logprobs: the decode path's measure.

``specs/baselines/offline_decode_ppl.json`` holds, per platform (``Platform.name``:
``cpu-reference``, ``nvidia-sm90``, ...), per workload and sample, the recorded values, and in
``_meta`` how they were recorded and the platform's tolerance: a sample passes when its ppl is
within ``ppl_rtol`` of the baseline (relative), at least ``min_greedy_agreement`` of its
greedy tokens match the baseline as a prefix, or the first token that differs is a near-tie
(this run's logprob of the baseline's token is within ``greedy_tie_margin`` of its own choice),
and over the agreeing prefix every greedy logprob is within ``greedy_logprob_atol`` of the
baseline's (at a near-tie also this run's logprob of the baseline's token: that step still had
the baseline's context). After a near-tie the two continuations are different texts and nothing
further is compared.

Each platform's entry records the compute dtype of each workload, and validation runs the
workload in that dtype. ``cpu-reference`` is recorded in float32: in bf16 a CPU's result
depends on which kernels its ISA gets (oneDNN / MKL paths differ between AVX-512 and AVX2), and
a rounding difference that flips one MoE routing choice moves a perplexity by percents, while
in float32 the same machines agree to ~1e-6. A platform with no entry runs in the reference's
dtype where it supports it and is compared, for information only, with ``cpu-reference`` under
the reference's ``cross_platform_tolerance``. ``refresh`` re-records one platform's entry (the
chosen workloads of it, in ``dtype`` when given) on purpose.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import sys
import time
import tomllib
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from deepinfer_core.conformance import checkpoints, jsonsafe
from deepinfer_core.conformance.spec import SpecError, dtype_from_name, dtype_name, specs_dir

REFERENCE_PLATFORM = "cpu-reference"
REFERENCE_DTYPE = "float32"  # what cpu-reference records in: its bf16 results depend on the CPU's ISA
META = "_meta"
BASELINE_FILE = Path("baselines") / "offline_decode_ppl.json"
RECORD_COMMAND = "deepinfer conformance --e2e --refresh --backend {backend}"


def record_command(backend: str, platform: str) -> str:
    """The command that records ``platform``'s entry (the reference's in float32)."""
    return RECORD_COMMAND.format(backend=backend) + (f" --dtype {REFERENCE_DTYPE}" if platform == REFERENCE_PLATFORM else "")
# A platform recorded for the first time gets this tolerance (the documented one for a bf16
# platform); review it against repeated runs. A logit of 8..16 in bf16 moves in steps of 0.06.
DEFAULT_TOLERANCE = {"ppl_rtol": 5e-3, "min_greedy_agreement": 1.0, "greedy_tie_margin": 0.05, "greedy_logprob_atol": 0.05}
# Used when the reference entry does not say how close another platform should come to it (the
# comparison runs in the reference's dtype, float32).
DEFAULT_CROSS_PLATFORM_TOLERANCE = {"ppl_rtol": 1e-3, "min_greedy_agreement": 1.0, "greedy_tie_margin": 1e-2,
                                    "greedy_logprob_atol": 1e-2}
TOLERANCE_KEYS = ("ppl_rtol", "min_greedy_agreement", "greedy_tie_margin", "greedy_logprob_atol")
MAX_MODEL_LEN = 512
GREEDY_LOGPROBS = 5  # top logprobs kept per greedy step, to tell a near-tie from a real divergence


@dataclass(frozen=True)
class Sample:
    id: str
    prompt: str
    continuation: str


@dataclass(frozen=True)
class Workload:
    name: str
    checkpoint: str
    dtype: str  # "auto" (the checkpoint's dtype) or a dtype name
    prompts: str  # file name under specs/workloads/
    max_tokens: int
    samples: tuple[Sample, ...]
    description: str = ""


@dataclass
class SampleResult:
    ppl: float
    greedy_tokens: list[int]
    greedy_logprobs: list[float]  # logprob of each greedy token, from the step that chose it
    # per greedy step: {token: logprob} of the top GREEDY_LOGPROBS tokens (not recorded in baselines)
    greedy_top_logprobs: list[dict[int, float]] = field(default_factory=list, repr=False)


@dataclass
class Measurement:
    """What one run measured: where it ran and, per workload and sample, the values."""

    platform: str
    backend: str
    device: str
    results: dict[str, dict[str, SampleResult]]
    workload_info: dict[str, dict]  # per workload: checkpoint, its fingerprint, compute dtype, max_tokens


@dataclass
class Row:
    """One sample compared against its baseline."""

    workload: str
    sample: str
    ppl: float
    baseline_ppl: float | None
    rel_diff: float | None
    greedy_agreement: float | None
    passed: bool
    reason: str = ""
    greedy_tie: bool = False  # the greedy tokens diverged at a near-tie (excused)
    logprob_diff: float | None = None  # largest |greedy logprob - baseline's| over the agreeing tokens


class UsageError(ValueError):
    """The run cannot start as asked (unknown workload, backend that cannot load...)."""


# ---- workloads -----------------------------------------------------------------------------------
def workloads_dir() -> Path:
    return specs_dir() / "workloads"


def baseline_path() -> Path:
    return specs_dir() / BASELINE_FILE


def workload_names() -> list[str]:
    return sorted(p.stem for p in workloads_dir().glob("*.toml"))


def load_workloads(names: list[str] | None = None) -> list[Workload]:
    """The workloads of specs/workloads/ (all, or those named, in the order given)."""
    known = workload_names()
    if names is None:
        names = known
    if not names:
        raise UsageError(f"no workload selected; known: {', '.join(known)}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"unknown workload(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    return [_load_workload(name) for name in dict.fromkeys(names)]


def _load_workload(name: str) -> Workload:
    path = workloads_dir() / f"{name}.toml"
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SpecError(f"{path}: {e}") from e
    expected = {"checkpoint", "dtype", "prompts", "max_tokens", "description"}
    extra = set(raw) - expected
    missing = {"checkpoint", "prompts", "max_tokens"} - set(raw)
    if extra or missing:
        raise SpecError(f"{path}: " + "; ".join(
            ([f"unknown key(s) {sorted(extra)}"] if extra else []) + ([f"missing key(s) {sorted(missing)}"] if missing else [])
        ))
    if raw["checkpoint"] not in checkpoints.checkpoint_names():
        raise SpecError(f"{path}: checkpoint {raw['checkpoint']!r} is not one of {', '.join(checkpoints.checkpoint_names())}")
    dtype = str(raw.get("dtype", "auto"))
    if dtype != "auto":
        try:
            dtype_from_name(dtype)
        except ValueError as e:
            raise SpecError(f"{path}: {e}") from e
    max_tokens = raw["max_tokens"]
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SpecError(f"{path}: max_tokens must be a positive integer, got {max_tokens!r}")
    return Workload(
        name=name,
        checkpoint=raw["checkpoint"],
        dtype=dtype,
        prompts=raw["prompts"],
        max_tokens=max_tokens,
        samples=_load_samples(workloads_dir() / raw["prompts"]),
        description=raw.get("description", ""),
    )


def _load_samples(path: Path) -> tuple[Sample, ...]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SpecError(f"cannot read prompt set {path}: {e}") from e
    samples: list[Sample] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            sample = Sample(id=record["id"], prompt=record["prompt"], continuation=record["continuation"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpecError(f"{path}:{number}: each line must be a JSON object with id, prompt, continuation ({e})") from e
        if not all(isinstance(v, str) and v for v in (sample.id, sample.prompt, sample.continuation)):
            raise SpecError(f"{path}:{number}: id, prompt and continuation must be non-empty strings")
        if sample.id.startswith("_") or any(s.id == sample.id for s in samples):
            raise SpecError(f"{path}:{number}: sample id {sample.id!r} is repeated or starts with '_'")
        samples.append(sample)
    if not samples:
        raise SpecError(f"{path}: no samples")
    return tuple(samples)


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype name a checkpoint's config.json declares (what dtype "auto" means)."""
    config = json.loads((model_dir / "config.json").read_text())
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return dtype_name(dtype_from_name(name))


# ---- running -------------------------------------------------------------------------------------
def run_workload(llm, workload: Workload) -> dict[str, SampleResult]:
    """Teacher-forced perplexity and greedy tokens of every sample, in one generate call."""
    from deepinfer_core.sampling.params import SamplingParams

    tokenizer = llm.tokenizer
    prompts, continuations = [], []
    for s in workload.samples:
        prompts.append(list(tokenizer(s.prompt).input_ids))
        continuations.append(list(tokenizer(s.continuation, add_special_tokens=False).input_ids))
    teacher = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    greedy = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True, logprobs=GREEDY_LOGPROBS)
    n = len(workload.samples)
    outputs = llm.generate(
        [p + c for p, c in zip(prompts, continuations)] + prompts, [teacher] * n + [greedy] * n, use_tqdm=False
    )
    results = {}
    for i, s in enumerate(workload.samples):
        logprobs = outputs[i].prompt_logprobs
        full = prompts[i] + continuations[i]
        lps = [logprobs[pos][full[pos]] for pos in range(len(prompts[i]), len(full))]
        completion = outputs[n + i].outputs[0]
        nll = -math.fsum(lps) / len(lps)
        top = list(completion.logprobs or [])
        results[s.id] = SampleResult(
            ppl=math.exp(nll) if nll < 700 else math.inf,  # a broken backend must fail the check, not crash it
            greedy_tokens=list(completion.token_ids),
            greedy_logprobs=[step[token] for step, token in zip(top, completion.token_ids)],
            greedy_top_logprobs=top,
        )
    return results


def measure(backend: str | None, workloads: list[Workload], cache_dir: str | Path | None = None, log=print) -> Measurement:
    """Run every workload on ``backend`` (as ``LLM(accelerator=...)`` takes it; None: automatic)."""
    import torch

    from deepinfer_core.api import LLM

    platform = backend_name = device = None
    results: dict[str, dict[str, SampleResult]] = {}
    info: dict[str, dict] = {}
    for i, w in enumerate(workloads, 1):
        t0 = time.perf_counter()
        model_dir = checkpoints.materialize(w.checkpoint, cache_dir)
        dtype = checkpoint_dtype(model_dir) if w.dtype == "auto" else dtype_name(dtype_from_name(w.dtype))
        # byte-level BPE: at most one token per byte, plus BOS
        longest = max(len((s.prompt + s.continuation).encode()) + 1 for s in w.samples)
        llm = LLM(
            model=model_dir,
            accelerator=backend,
            dtype=dtype,
            max_model_len=max(MAX_MODEL_LEN, longest + w.max_tokens),
            max_num_seqs=2 * len(w.samples),
            seed=0,
            progress=False,
        )
        engine = llm.engine
        if platform is None:
            platform, backend_name = engine.platform.name, engine.backend.name
            device = str(engine.platform.extra.get("device_name") or engine.platform.device)
        elif engine.platform.name != platform:
            raise RuntimeError(f"workload {w.name} ran on platform {engine.platform.name}, the ones before on {platform}")
        results[w.name] = run_workload(llm, w)
        info[w.name] = {
            "checkpoint": w.checkpoint,
            "checkpoint_fingerprint": checkpoints.fingerprint(w.checkpoint),
            "dtype": dtype,
            "max_tokens": w.max_tokens,
        }
        del llm, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log(f"[{i}/{len(workloads)}] {w.name}: {len(w.samples)} samples on {platform} ({dtype}, checkpoint {w.checkpoint}) "
            f"in {time.perf_counter() - t0:.1f} s")
    return Measurement(platform, backend_name, device, results, info)


# ---- comparing -----------------------------------------------------------------------------------
def leading_agreement(tokens: list[int], baseline: list[int]) -> int:
    """How many leading tokens equal the baseline's."""
    same = 0
    for a, b in zip(tokens, baseline):
        if a != b:
            break
        same += 1
    return same


def greedy_agreement(tokens: list[int], baseline: list[int]) -> float:
    """Leading tokens equal to the baseline's, as a fraction of the baseline's length."""
    return leading_agreement(tokens, baseline) / len(baseline) if baseline else 1.0


def compare(
    results: dict[str, dict[str, SampleResult]], entry: dict, tolerance: dict, hint: str = ""
) -> list[Row]:
    """Each measured sample against ``entry`` (one platform's baseline) within ``tolerance``."""
    rtol, min_agree = float(tolerance["ppl_rtol"]), float(tolerance["min_greedy_agreement"])
    tie_margin = float(tolerance.get("greedy_tie_margin", 0.0))
    lp_atol = float(tolerance.get("greedy_logprob_atol", 0.0))
    rows = []
    for workload, samples in results.items():
        recorded = entry.get(workload)
        for sample, r in samples.items():
            base = (recorded or {}).get(sample)
            if base is None:
                what = "workload" if recorded is None else "sample"
                rows.append(Row(workload, sample, r.ppl, None, None, None, False, f"no baseline for this {what}{hint}"))
                continue
            rel = abs(r.ppl - base["ppl"]) / base["ppl"]
            want = base["greedy_tokens"]
            same = leading_agreement(r.greedy_tokens, want)
            agree = same / len(want) if want else 1.0
            gap = _divergence_gap(r, want, same)
            tie = gap is not None and gap <= tie_margin
            reasons = []
            if not rel <= rtol:  # NaN fails
                reasons.append(f"ppl {r.ppl:.6g} vs baseline {base['ppl']:.6g}: rel diff {rel:.2e} > ppl_rtol {rtol:g}")
            if agree < min_agree and not tie:
                got = r.greedy_tokens[same] if same < len(r.greedy_tokens) else None
                why = (f"this run puts the baseline's token {gap:.3g} nats below its own" if gap is not None
                       else f"the baseline's token is not among this run's top {GREEDY_LOGPROBS}")
                reasons.append(
                    f"greedy tokens agree on {same}/{len(want)} leading tokens < min_greedy_agreement {min_agree:g}: "
                    f"token {same} is {got}, baseline {want[same]} ({why}; greedy_tie_margin {tie_margin:g})"
                )
            lp_diff = None
            if "greedy_logprobs" not in base:
                reasons.append(f"the baseline has no greedy_logprobs (recorded before the decode path was measured){hint}")
            elif same or tie:
                mine = r.greedy_logprobs[:same]
                if tie:  # the step that diverged still had the baseline's context: its token's logprob compares too
                    mine = [*mine, r.greedy_top_logprobs[same][want[same]]]
                diffs = [abs(a - b) for a, b in zip(mine, base["greedy_logprobs"])]
                lp_diff = max(d if d == d else math.inf for d in diffs)  # NaN counts as infinitely far
                if not lp_diff <= lp_atol:
                    step = diffs.index(max(diffs, key=lambda d: d if d == d else math.inf))
                    reasons.append(
                        f"greedy logprob of token {step} ({'prefill' if step == 0 else 'decode step'}) is "
                        f"{mine[step]:.6g}, baseline {base['greedy_logprobs'][step]:.6g}: diff {lp_diff:.2e} "
                        f"> greedy_logprob_atol {lp_atol:g}"
                    )
            rows.append(Row(workload, sample, r.ppl, base["ppl"], rel, agree, not reasons, "; ".join(reasons),
                            tie and same < len(want), lp_diff))
    return rows


def _divergence_gap(r: SampleResult, baseline: list[int], index: int) -> float | None:
    """At the first differing greedy step: this run's logprob of its token minus that of the
    baseline's token (None: no divergence, or the baseline's token is not in this run's top logprobs)."""
    if index >= len(baseline) or index >= len(r.greedy_tokens) or index >= len(r.greedy_top_logprobs):
        return None
    logprobs = r.greedy_top_logprobs[index]
    if baseline[index] not in logprobs or r.greedy_tokens[index] not in logprobs:
        return None
    return logprobs[r.greedy_tokens[index]] - logprobs[baseline[index]]


def _tolerance_text(tol: dict) -> str:
    return ", ".join(f"{k} {tol[k]:g}" for k in TOLERANCE_KEYS if k in tol)


def format_table(rows: list[Row], verdict: bool = True) -> str:
    """The report's table; GREEDY is the leading-token agreement, "tie" when the first difference
    is a near-tie (excused); LOGPROB DIFF the largest greedy-logprob difference over the agreeing tokens."""
    header = ("WORKLOAD", "SAMPLE", "PPL", "BASELINE", "REL DIFF", "GREEDY", "LOGPROB DIFF", "RESULT")
    lines = []
    for r in rows:
        result = ("PASS" if r.passed else "FAIL") if verdict else ("within" if r.passed else "outside")
        lines.append((
            r.workload,
            r.sample,
            f"{r.ppl:.6g}",
            "-" if r.baseline_ppl is None else f"{r.baseline_ppl:.6g}",
            "-" if r.rel_diff is None else f"{r.rel_diff:.2e}",
            "-" if r.greedy_agreement is None else f"{r.greedy_agreement:.2f}" + (" tie" if r.greedy_tie else ""),
            "-" if r.logprob_diff is None else f"{r.logprob_diff:.2e}",
            result,
        ))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *lines])


# ---- the baseline file ---------------------------------------------------------------------------
def read_baselines(path: Path | None = None) -> dict:
    path = path or baseline_path()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected an object keyed by platform")
    return data


def write_baselines(data: dict, path: Path | None = None) -> None:
    path = path or baseline_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")


def _recorded(results: dict[str, SampleResult]) -> dict[str, dict]:
    return {sid: {"greedy_logprobs": r.greedy_logprobs, "greedy_tokens": r.greedy_tokens, "ppl": r.ppl}
            for sid, r in results.items()}


def _non_finite(results: dict[str, dict[str, SampleResult]]) -> list[str]:
    """Samples whose measured values are not finite numbers (a broken run; never a baseline)."""
    return [f"{w}/{sid}" for w, rs in results.items() for sid, r in rs.items()
            if not all(math.isfinite(v) for v in [r.ppl, *r.greedy_logprobs])]


def refresh_entry(old: dict | None, m: Measurement, command: str) -> dict:
    """The platform's new entry: the measured workloads replaced, the others and the tolerances kept."""
    import torch

    from deepinfer_core import __version__

    entry = {k: v for k, v in (old or {}).items() if k != META}
    old_meta = (old or {}).get(META, {})
    meta = {
        "backend": m.backend,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "deepinfer": __version__,
        "device": m.device,
        "python": sys.version.split()[0],
        "tolerance": old_meta.get("tolerance", dict(DEFAULT_TOLERANCE)),
        "torch": torch.__version__,
        "workloads": {**old_meta.get("workloads", {}), **m.workload_info},
    }
    if m.platform == REFERENCE_PLATFORM:
        meta["cross_platform_tolerance"] = old_meta.get("cross_platform_tolerance", dict(DEFAULT_CROSS_PLATFORM_TOLERANCE))
    for key in set(old_meta) - set(meta):  # notes someone added by hand stay
        meta[key] = old_meta[key]
    for workload, results in m.results.items():
        entry[workload] = _recorded(results)
    entry[META] = meta
    return entry


def diff_entries(old: dict | None, new: dict, workloads: list[str]) -> list[str]:
    """Readable lines: what the refresh changed in ``workloads`` of one platform's entry."""
    old = old or {}
    lines, unchanged = [], 0
    for w in workloads:
        before, after = old.get(w, {}), new.get(w, {})
        for sid in sorted(set(before) | set(after)):
            a, b = before.get(sid), after.get(sid)
            if a is None:
                lines.append(f"  + {w}/{sid}: ppl {b['ppl']:.6g}, greedy {b['greedy_tokens']}")
            elif b is None:
                lines.append(f"  - {w}/{sid}: removed (no longer in the workload)")
            elif a == b:
                unchanged += 1
            else:
                parts = []
                if a["ppl"] != b["ppl"]:
                    parts.append(f"ppl {a['ppl']:.8g} -> {b['ppl']:.8g} (rel {(b['ppl'] - a['ppl']) / a['ppl']:+.2e})")
                if a["greedy_tokens"] != b["greedy_tokens"]:
                    agree = greedy_agreement(b["greedy_tokens"], a["greedy_tokens"])
                    parts.append(f"greedy tokens {a['greedy_tokens']} -> {b['greedy_tokens']} (agreement {agree:.2f})")
                if a.get("greedy_logprobs") != b["greedy_logprobs"]:
                    if "greedy_logprobs" not in a:
                        parts.append("greedy logprobs recorded")
                    else:
                        moved = max((abs(x - y) for x, y in zip(a["greedy_logprobs"], b["greedy_logprobs"])), default=0.0)
                        parts.append(f"greedy logprobs moved by up to {moved:.2e}")
                lines.append(f"  ~ {w}/{sid}: " + "; ".join(parts))
    was, now = old.get(META, {}).get("workloads", {}), new[META]["workloads"]
    for w in workloads:
        changed = [f"{k} {was[w].get(k)} -> {v}" for k, v in now.get(w, {}).items() if w in was and was[w].get(k) != v]
        if changed:
            lines.append(f"  workload {w}: {', '.join(changed)}")
    old_tol, new_tol = old.get(META, {}).get("tolerance"), new[META]["tolerance"]
    if old_tol != new_tol:
        lines.append(f"  tolerance: {old_tol} -> {new_tol}")
    lines.append(f"  {unchanged} sample(s) unchanged")
    return lines


# ---- which dtype each workload runs in -----------------------------------------------------------
def platform_of(backend: str | None) -> tuple[str, tuple[str, ...]]:
    """(platform name, compute dtype names it supports) of the backend as the engine would load it."""
    from deepinfer_core.conformance.ops_suite import resolve_backend

    _, platform, _ = resolve_backend(backend)
    return platform.name, tuple(dtype_name(d) for d in platform.supported_dtypes)


def recorded_dtype(entry: dict | None, workload: str) -> str | None:
    """The dtype a platform's entry recorded ``workload`` in (None: not recorded)."""
    return ((entry or {}).get(META, {}).get("workloads", {}).get(workload) or {}).get("dtype")


def plan(workloads: list[Workload], baselines: dict, platform: str, supported: tuple[str, ...],
         refresh: bool, dtype: str | None = None) -> list[Workload]:
    """The workloads with the compute dtype each runs in: ``dtype`` when given (refresh only); else
    the dtype the platform's entry recorded it in; cpu-reference otherwise in REFERENCE_DTYPE; a
    platform with no entry runs in the dtype of ``cpu-reference``'s entry where it supports it
    (so the comparison with it is like for like); otherwise the workload's own."""
    entry, reference = baselines.get(platform), baselines.get(REFERENCE_PLATFORM)
    out = []
    for w in workloads:
        if dtype is not None:
            chosen = dtype
        elif recorded_dtype(entry, w.name):
            chosen = recorded_dtype(entry, w.name)
        elif platform == REFERENCE_PLATFORM:
            chosen = REFERENCE_DTYPE
        elif entry is None and not refresh and recorded_dtype(reference, w.name) in supported:
            chosen = recorded_dtype(reference, w.name)
        else:
            chosen = w.dtype
        out.append(replace(w, dtype=chosen))
    return out


# ---- entry point ---------------------------------------------------------------------------------
def main(
    backend: str | None,
    workloads: list[str] | None = None,
    refresh: bool = False,
    json_out: str | None = None,
    structured: bool = False,
    dtype: str | None = None,
) -> int:
    """Run the end-to-end workloads on ``backend`` and validate them against (or, with
    ``refresh``, record them as) the platform's baseline. Prints the report; returns 0 when every
    sample passes, 1 when any fails or the platform has no baseline, 2 when the run cannot start
    (unknown workload, malformed specs, a backend that cannot load, ``dtype`` without
    ``refresh``). ``structured``: then the structured-output checks too (``conformance.structured``;
    a failure of theirs is a 1)."""
    code = _workloads(backend, workloads, refresh, json_out, dtype)
    if structured and code != 2:
        from deepinfer_core.conformance import structured as checks

        code = max(code, checks.report(backend))
    return code


def _workloads(backend: str | None, workloads: list[str] | None, refresh: bool, json_out: str | None, dtype: str | None) -> int:
    from deepinfer_core.config import ConfigError
    from deepinfer_core.plugins import BackendError

    try:
        if dtype is not None:
            if not refresh:
                raise UsageError(f"--dtype {dtype} applies to --refresh only: validation runs each workload in the dtype "
                                 f"its baseline was recorded in")
            dtype = dtype_name(dtype_from_name(dtype))
        chosen = load_workloads(workloads)
        path = baseline_path()
        baselines = read_baselines(path)
    except (UsageError, SpecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        platform, supported = platform_of(backend)
        if dtype is not None and dtype not in supported:
            raise UsageError(f"platform {platform} does not support {dtype} (it supports {', '.join(supported)})")
    except (BackendError, UsageError) as e:
        print(f"error: cannot run the workloads: {e}", file=sys.stderr)
        return 2
    chosen = plan(chosen, baselines, platform, supported, refresh, dtype)
    print(f"e2e conformance: {len(chosen)} workload(s) ({', '.join(w.name for w in chosen)}), backend {backend or 'auto'}")
    try:
        m = measure(backend, chosen)
    except (BackendError, ConfigError, checkpoints.CheckpointMismatch) as e:
        print(f"error: cannot run the workloads: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the backend failed mid-run: that is a conformance failure, reported as such
        traceback.print_exc()
        print(f"FAIL: the run failed on backend {backend or 'auto'}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    record_backend = backend or m.backend
    report = {"platform": m.platform, "backend": m.backend, "device": m.device, "baseline_file": str(path),
              "workloads": m.workload_info, "results": {w: _recorded(rs) for w, rs in m.results.items()}}

    if refresh:
        broken = _non_finite(m.results)
        if broken:
            print(f"FAIL: not recording a baseline for {m.platform}: samples {', '.join(broken)} measured non-finite "
                  f"perplexities or logprobs (the backend is broken)", file=sys.stderr)
            report.update(status="fail", exit_code=1, non_finite=broken)
            _write_json(json_out, report)
            return 1
        old = baselines.get(m.platform)
        command = RECORD_COMMAND.format(backend=record_backend)
        if workloads:
            command += " --workloads " + ",".join(w.name for w in chosen)
        if dtype:
            command += f" --dtype {dtype}"
        new = refresh_entry(old, m, command)
        print(f"\nrefreshing the baseline of platform {m.platform} in {path} ({'new entry' if old is None else 'replacing'} "
              f"workload(s) {', '.join(m.results)}; other platforms untouched):")
        print("\n".join(diff_entries(old, new, list(m.results))))
        if old is None:
            print(f"  tolerance set to the default {new[META]['tolerance']}: review it against repeated runs")
        baselines[m.platform] = new
        write_baselines(baselines, path)
        report.update(status="refreshed", exit_code=0)
        _write_json(json_out, report)
        return 0

    entry = baselines.get(m.platform)
    if entry is None:
        print(f"\nno baseline for platform {m.platform!r} in {path}: this run cannot pass.")
        print(f"record one (deliberately, on a machine of that platform) with:\n  {record_command(record_backend, m.platform)}")
        reference = baselines.get(REFERENCE_PLATFORM)
        if reference is None or m.platform == REFERENCE_PLATFORM:
            report.update(status="no-baseline", exit_code=1)
            _write_json(json_out, report)
            return 1
        tol = {**DEFAULT_CROSS_PLATFORM_TOLERANCE, **reference.get(META, {}).get("cross_platform_tolerance", {})}
        alike = {w: rs for w, rs in m.results.items()  # a workload the reference lacks is reported by compare()
                 if recorded_dtype(reference, w) in (None, m.workload_info[w]["dtype"])}
        for w in sorted(set(m.results) - set(alike)):
            print(f"not compared: workload {w} ran in {m.workload_info[w]['dtype']}, {REFERENCE_PLATFORM} recorded it in "
                  f"{recorded_dtype(reference, w)}, which platform {m.platform} does not support")
        rows = compare(alike, reference, tol, hint=f" on {REFERENCE_PLATFORM}")
        print(f"\nfor information only, against {REFERENCE_PLATFORM} with the cross-platform tolerance ({_tolerance_text(tol)}):")
        print(format_table(rows, verdict=False))
        within = sum(r.passed for r in rows)
        print(f"\n{within}/{len(rows)} samples within the cross-platform tolerance of {REFERENCE_PLATFORM}; "
              f"NOT VALIDATED: platform {m.platform} has no baseline")
        report.update(status="no-baseline", exit_code=1, compared_with=REFERENCE_PLATFORM, tolerance=tol,
                      rows=[asdict(r) for r in rows])
        _write_json(json_out, report)
        return 1

    tol = {**DEFAULT_TOLERANCE, **entry.get(META, {}).get("tolerance", {})}
    hint = f" on {m.platform}; record it with {record_command(record_backend, m.platform)}"
    rows = compare(m.results, entry, tol, hint=hint)
    recorded_on = entry.get(META, {}).get("workloads", {})
    for w, info in m.workload_info.items():
        was = recorded_on.get(w, {})
        changed = [k for k in ("checkpoint_fingerprint", "dtype", "max_tokens") if k in was and was[k] != info[k]]
        if changed:
            print(f"warning: workload {w}: {', '.join(f'{k} {was[k]} -> {info[k]}' for k in changed)} since the baseline "
                  f"was recorded; the baseline is stale: refresh it deliberately")
    print(f"\nplatform {m.platform} against its baseline ({_tolerance_text(tol)}):")
    print(format_table(rows))
    failed = [r for r in rows if not r.passed]
    for r in failed:
        print(f"FAIL {r.workload}/{r.sample}: {r.reason}")
    print(f"\n{len(rows) - len(failed)}/{len(rows)} samples passed on {m.platform}: {'FAIL' if failed else 'PASS'}")
    code = 1 if failed else 0
    report.update(status="fail" if failed else "pass", exit_code=code, compared_with=m.platform, tolerance=tol,
                  rows=[asdict(r) for r in rows])
    _write_json(json_out, report)
    return code


def _write_json(path: str | None, report: dict) -> None:
    if path:
        jsonsafe.write(report, path)
