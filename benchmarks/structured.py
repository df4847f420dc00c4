"""Structured outputs, measured through ``LLM.generate``: decode tokens/s with every request
constrained by a JSON schema against the same requests unconstrained, and the host cost of one
grammar mask.

Parts (``--parts``, comma-separated):

* ``e2e``: ``--model`` (the embedded default model, or a benchmarks.models shape with random
  weights and the default model's tokenizer: a real model's step beside the same masks), B
  requests (``--batches``), ``--max-tokens`` tokens each: free (ignore_eos) against every
  request under the JSON schema ``--schema``:

  - ``record`` (the default, ``RECORD``): a flat record of 32 required properties (integers,
    strings, booleans, enums, an array of strings, a nested object), no others allowed: a
    realistic schema. Every key is forced text, so its shortest valid output is 263 tokens of
    the default tokenizer (its fewest-token spelling; 264 as the tokenizer encodes it).
  - ``stress`` (``STRESS``): an array of at least ``MIN_ITEMS`` integers, a worst case:
    xgrammar's counted repetition makes its fill and accept costs grow with the position.
    Along the default model's 444 greedy tokens on a 2-core CI host, one matcher's fill went
    from 12 to 370 us and its accept from 3 to 34 us (medians of the first and last 50),
    where ``record``'s stayed at 2 and 1 us.

  Neither can end within 128 tokens, so up to that ``--max-tokens`` every constrained request
  runs to it and both sides emit the same number of tokens. First call and best repeated call;
  tokens/s count the tokens the outputs hold; each point names its schema.
* ``mask``: the host time of ``structured.bitmask`` for B rows, each at a position inside
  an array of numbers (``[0, 1`` ...: few tokens allowed) and inside a string of an array of
  strings (``["ab``: almost every token allowed, xgrammar's dearest case). It is run for the default
  model's tokenizer and for a synthetic vocabulary of ``--synthetic-vocab`` strings, to show
  how the cost grows with a DeepSeek-size vocabulary. No tokenizer of that size is stored
  here; the synthetic strings are the default tokenizer's pieces, their pairs, and digit and
  letter runs (the number state is under ``STRESS``, a few items in). Each point is timed
  three times: ``ms`` as the engine fills masks (``structured.bitmask``), ``ms_batch`` by
  xgrammar's batch matcher for every row and ``ms_loop`` one row at a time (which
  ``structured.BATCH_FILL_MIN_ROWS`` chooses between).

Writes ``structured.json`` (and prints every point) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.generate import guarded, metadata, model_with_tokenizer, sync

MIN_ITEMS = 200  # array items: more tokens than any max_tokens here, so no request ends early
STRESS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": MIN_ITEMS}
_S, _B = {"type": "string"}, {"type": "boolean"}


def _int(minimum: int | None = None, maximum: int | None = None) -> dict:
    return {"type": "integer", **({} if minimum is None else {"minimum": minimum}), **({} if maximum is None else {"maximum": maximum})}


_FIELDS = {
    "id": _int(1), "username": _S, "full_name": _S, "email": _S, "age": _int(0, 130), "is_active": _B, "is_verified": _B,
    "role": {"enum": ["admin", "editor", "viewer", "guest"]}, "department": _S, "job_title": _S, "manager_id": _int(1),
    "phone": _S, "country": _S, "city": _S, "timezone": _S, "language": _S, "signup_year": _int(1990, 2030),
    "login_count": _int(0), "failed_logins": _int(0, 100), "newsletter": _B, "two_factor": _B,
    "plan": {"enum": ["free", "pro", "team", "enterprise"]}, "credits": _int(0), "score": _int(0, 100), "notes": _S,
    "website": _S, "company": _S, "employee_count": _int(1), "tags": {"type": "array", "items": _S, "maxItems": 5},
    "address": {"type": "object", "additionalProperties": False, "required": ["street", "postal_code", "city", "country_code"],
                "properties": {"street": _S, "postal_code": _S, "city": _S, "country_code": _S}},
    "last_login_day": _int(1, 31), "referral_code": _S,
}
RECORD = {"type": "object", "additionalProperties": False, "required": list(_FIELDS), "properties": _FIELDS}
SCHEMAS = {"record": (RECORD, "user = "), "stress": (STRESS, "numbers = [")}  # name: (schema, prompt)


def e2e(args) -> list[dict]:
    from deepinfer_core import LLM, SamplingParams

    path = model_with_tokenizer(args.model, args.layers)
    llm = LLM(model=path, accelerator=args.accelerator, dtype=args.dtype, progress=False, max_num_seqs=max(args.batches),
              load_format="dummy" if path else "safetensors")
    schema, prompt = SCHEMAS[args.schema]
    out = []
    for batch in args.batches:
        for mode in ("free", "json"):
            so = {"json": schema} if mode == "json" else None
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, so_args=so)
            runs = []
            for _ in range(1 + args.repeats):
                sync(llm.engine.device)
                t = time.perf_counter()
                outputs = llm.generate([prompt] * batch, params, use_tqdm=False)
                sync(llm.engine.device)
                runs.append((time.perf_counter() - t, sum(len(c.token_ids) for o in outputs for c in o.outputs)))
            (first_s, tokens), best = runs[0], min(r[0] for r in runs[1:])
            point = {"mode": mode, "schema": args.schema, "batch": batch, "first_s": first_s, "repeat_s": best, "emitted_tokens": tokens,
                     "tokens_per_s_first": tokens / first_s, "tokens_per_s": tokens / best,
                     "async_scheduling": llm.engine.async_scheduling,
                     "finish_reasons": sorted({c.finish_reason for o in outputs for c in o.outputs})}
            if args.profile:
                point["profile"] = _profile(lambda: llm.generate([prompt] * batch, params, use_tqdm=False), llm.engine.device)
            out.append(point)
            print(f"[e2e] {mode} ({args.schema}) B={batch}: {point['tokens_per_s']:.0f} tok/s repeated ({point['tokens_per_s_first']:.0f} first call)", flush=True)
    free = {p["batch"]: p["tokens_per_s"] for p in out if p["mode"] == "free"}
    for p in out:
        p["over_free"] = p["tokens_per_s"] / free[p["batch"]]
    return out


def _profile(call, device) -> dict:
    """Where one more call's time goes: the host's functions (cProfile, top 25 by own time) and
    the device's busy time (the sum of its kernels' times, torch.profiler) against the wall time."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prof = cProfile.Profile()
    sync(device)
    t = time.perf_counter()
    prof.runcall(call)
    sync(device)
    wall = time.perf_counter() - t
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    result = {"host_wall_s": wall, "host_top": text.getvalue().splitlines()[-40:]}
    if device.type == "cuda":
        with torch_profile(activities=[ProfilerActivity.CUDA]) as tp:
            t = time.perf_counter()
            call()
            sync(device)
            result["device_wall_s"] = time.perf_counter() - t
        result["device_busy_s"] = sum(e.device_time_total for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    print("\n".join(result["host_top"]), flush=True)
    print(f"[profile] wall {wall:.3f} s under cProfile; device busy {result.get('device_busy_s', 0):.3f} of "
          f"{result.get('device_wall_s', 0):.3f} s", flush=True)
    return result


def synthetic_vocab(tokenizer, size: int) -> list[str]:
    """``size`` distinct strings: the tokenizer's own pieces, then pairs of them, then digit and
    letter runs (a stand-in for a large BPE vocabulary's mix of words, fragments and numbers)."""
    pieces = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
    vocab, seen = [], set()
    for s in pieces:
        vocab.append(s)
        seen.add(s)
    i = 0
    while len(vocab) < size:
        a, b = pieces[i % len(pieces)], pieces[(i * 7919 + 13) % len(pieces)]
        for s in (a + b, str(i), "x" * (1 + i % 7) + str(i % 100)):
            if s not in seen and len(vocab) < size:
                vocab.append(s)
                seen.add(s)
        i += 1
    return vocab


def mask(args) -> list[dict]:
    import xgrammar

    from deepinfer_core.api import resolve_model_dir
    from deepinfer_core.engine.startup import load_tokenizer
    from deepinfer_core.engine.sequence import Sequence
    from deepinfer_core.sampling import structured
    from deepinfer_core.sampling.params import SamplingParams
    from deepinfer_core.sampling.sampler import SampleRow

    tokenizer = load_tokenizer(resolve_model_dir(None))
    infos = {"default": (xgrammar.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id]), len(tokenizer))}
    vocab = synthetic_vocab(tokenizer, args.synthetic_vocab)
    infos[f"synthetic-{len(vocab)}"] = (xgrammar.TokenizerInfo(vocab, stop_token_ids=[0]), len(vocab))
    params = SamplingParams(so_args={"json": STRESS})
    states = {  # name: (schema, the text each row's matcher has accepted, by row index)
        "number": (STRESS, lambda i: "[" + ", ".join(str(j) for j in range(1 + i % 9))),
        "string": ({"type": "array", "items": {"type": "string"}}, lambda i: '["' + "ab" * (1 + i % 5)),
    }
    out = []
    batch_matcher = xgrammar.BatchGrammarMatcher()  # one pool, as the engine keeps one
    for name, (info, size) in infos.items():
        compiler = xgrammar.GrammarCompiler(info)
        for state, (schema, prefix) in states.items():
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            for batch in args.batches:
                rows = []
                for i in range(batch):
                    matcher = xgrammar.GrammarMatcher(compiled)
                    assert matcher.accept_string(prefix(i)), prefix(i)
                    rows.append(SampleRow(Sequence(i, str(i), 0, [1], params, 0, grammar=matcher)))
                words = (size + 31) // 32
                buffer = torch.full((batch, words), -1, dtype=torch.int32)
                fills = {
                    "ms": lambda: structured.bitmask(rows, size),
                    "ms_batch": lambda: batch_matcher.batch_fill_next_token_bitmask(
                        [r.seq.grammar for r in rows], buffer, list(range(batch))),
                    "ms_loop": lambda: [r.seq.grammar.fill_next_token_bitmask(buffer, i) for i, r in enumerate(rows)],
                }
                point = {"vocab": name, "vocab_size": size, "state": state, "batch": batch}
                for key, fill in fills.items():
                    times = []
                    for _ in range(20):
                        t = time.perf_counter()
                        fill()
                        times.append(time.perf_counter() - t)
                    point[key] = 1e3 * sorted(times)[len(times) // 2]
                point["us_per_row"] = 1e3 * point["ms"] / batch
                out.append(point)
                print(f"[mask] {name} {state} B={batch}: {point['ms']:.3f} ms ({point['us_per_row']:.1f} us per row); batch matcher "
                      f"{point['ms_batch']:.3f} ms, one by one {point['ms_loop']:.3f} ms", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="e2e,mask")
    p.add_argument("--model", default="default", help="e2e: 'default' or a benchmarks.models name (random weights)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--accelerator")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="record", help="e2e: the constraint (see the module docstring)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-fill-min-rows", type=int, default=None,
                   help="structured.BATCH_FILL_MIN_ROWS for this run (a large value: masks filled one row at a time)")
    p.add_argument("--profile", action="store_true", help="e2e: one more call per point under cProfile and torch.profiler")
    p.add_argument("--synthetic-vocab", type=int, default=129280, help="mask part: DeepSeek-V3's vocabulary size")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    args.batches = [int(v) for v in args.batches.split(",")]
    if args.batch_fill_min_rows is not None:
        from deepinfer_core.sampling import structured

        structured.BATCH_FILL_MIN_ROWS = args.batch_fill_min_rows
    from deepinfer_core.sampling import structured

    meta = {**metadata(args), "usable_cpus": structured.usable_cpus(), "cpu_count": os.cpu_count()}  # the batch matcher's pool
    print(f"[host] {meta['usable_cpus']} usable CPUs of {meta['cpu_count']}", flush=True)
    report = {"meta": meta, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "structured.json"
    for part, fn in (("e2e", e2e), ("mask", mask)):
        if part in args.parts.split(","):
            report[part] = guarded(fn, args)
            report["meta"]["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
            path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
