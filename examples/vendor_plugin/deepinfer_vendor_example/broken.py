"""``vendor_example_broken``: the ``vendor_example`` backend with ONE DELIBERATE BUG.

It exists only to show that ``deepinfer conformance`` catches a wrong kernel: never select it for
anything else. Its ``mla_decode_attention`` has an off-by-one that a real port can easily make:
it reads ``seq_lens`` as the position of each sequence's newest token instead of the number of
cached tokens, so every query row attends to one entry too few: the newest token (the query's
own latent, written just before) is never attended to, nor, with several query rows per
sequence, is any row's own. Outputs stay finite and plausible, a model still produces text, and only a
comparison with the reference shows the difference. Every other op is ``vendor_example``'s own.

Same opt-in probe as ``vendor_example``, same platform name (it is the same chip with a
regressed kernel, so it must fail against that platform's end-to-end baseline too), and a
priority below the reference's, so automatic selection never picks it.
"""

from __future__ import annotations

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl
from deepinfer_vendor_example import backend

NAME = "vendor_example_broken"
BROKEN_OP = "mla_decode_attention"


def mla_decode_attention_off_by_one(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale):
    from deepinfer_vendor_example.ops import padded_decode_attention

    return padded_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens - 1, query_start_loc, scale)  # the bug


mla_decode_attention_off_by_one.impl = "torch (vendor example, DELIBERATELY BROKEN): drops each sequence's newest token (each query row's own)"


@hookimpl
def deepinfer_backend() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        priority=-1,  # below the reference: never auto-selected, only by name
        min_spec_version=3,
        max_spec_version=3,
        description=f"DELIBERATELY BROKEN copy of vendor_example ({BROKEN_OP} drops the newest token); shows conformance failing",
    )


@hookimpl
def deepinfer_probe() -> ProbeResult:
    return backend.probe()


@hookimpl
def deepinfer_platform():
    return backend.make_platform(NAME)


@hookimpl
def deepinfer_ops(platform, model_config):
    return {**backend.vendor_ops(), BROKEN_OP: mla_decode_attention_off_by_one}
