"""The NVIDIA backend's kernels judged by the conformance kit itself: what ``deepinfer conformance
--backend nvidia`` runs (``ops_suite.run_op``), op by op, on the plugin's own op table.

With CUDA: every declared shape of specs/ops.toml, in bf16 and float32, plus the kit's hypothesis
cases. Without CUDA the Triton kernels run in the interpreter (float32, see conftest.py): only the
declared shapes whose inputs hold at most CPU_MAX_ELEMENTS values (the kit's ``max_elements``;
every op keeps its small, awkward shapes) and CPU_EXAMPLES hypothesis cases around them.
sample_tokens' declared shapes then run without the kit's statistical draws (up to 3 rows x
4000 draws per shape, each draw one interpreted program of ~17 ms: over ten minutes);
test_sampling_kernels.py checks its distribution at the spec's draw count.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_core.conformance.inputs import CaseTooLarge, make_case  # noqa: E402
from deepinfer_core.conformance.ops_suite import ReplayCase, replay_case, run_op  # noqa: E402
from deepinfer_core.conformance.spec import dtype_name, shapes  # noqa: E402
from deepinfer_nvidia_sm100 import backend as nvidia  # noqa: E402

ON_GPU = torch.cuda.is_available()
# Interpreted, the largest shapes this admits (every decode shape, V3's 256-expert routing, V2-Lite's
# vocabulary) take a second or two each; it leaves out real-size weights (GEMMs, experts), V3's
# vocabulary, 128-head prefill and the YaRN tables of 163840 positions.
CPU_MAX_ELEMENTS = 1 << 21
CPU_EXAMPLES = 4
OPS = nvidia.deepinfer_ops(platform=None, model_config=None, batch_invariant=False)  # the table the engine and the CLI get
KV_RECORDS = nvidia.FP8_KV_CACHE  # the kit's FP8 KV record shapes run where the platform takes records


def _declared_without_draws(op: str, fn, dtype: torch.dtype, device) -> int:
    """sample_tokens on the CPU: each declared shape that fits, as the kit judges it (greedy rows
    exactly, sampled rows inside the support) without its statistical draws. Returns the count."""
    ran = 0
    for dims in shapes(op):
        try:
            make_case(op, dims, dtype, "cpu", 0, max_elements=CPU_MAX_ELEMENTS)
        except CaseTooLarge:
            continue
        report = replay_case(ReplayCase(op, dtype_name(dtype), dims, 0), fn, device)
        assert report.result == "PASS", f"{op} {dims}: {report.detail()}"
        ran += 1
    return ran


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_kernel_passes_the_kit(op, device, dtype):
    fn = OPS[op]
    if ON_GPU:
        report = run_op(op, fn, dtype, device, kv_records=KV_RECORDS)
    elif op == "sample_tokens":
        assert _declared_without_draws(op, fn, dtype, device) >= 3
        return
    else:
        report = run_op(op, fn, dtype, device, examples=CPU_EXAMPLES, max_elements=CPU_MAX_ELEMENTS, kv_records=KV_RECORDS)
    assert report.result == "PASS", f"{op} ({report.dtype}): {report.detail()}"
    assert report.cases >= len(shapes(op)) - report.skipped > 0, (report.cases, report.skipped)


def test_the_table_is_every_op_but_those_left_to_the_reference():
    """Every op is the plugin's own except the V4 ones it names as left to the reference (none of
    V2/V3's falls back), so the test above judges all of its kernels."""
    from deepinfer_core.ops import V4_OP_NAMES, OP_NAMES

    assert set(OPS) == set(OP_NAMES) - nvidia.LEFT_TO_REFERENCE
    assert nvidia.LEFT_TO_REFERENCE <= set(V4_OP_NAMES)
