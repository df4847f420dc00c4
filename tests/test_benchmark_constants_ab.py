"""benchmarks/constants_ab.py's arguments on the CPU: what each --set and --drop changes, and
the errors that name a wrong one. (The A/B itself needs the GPU.)"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed: the NVIDIA kernel modules cannot be imported")

from benchmarks import constants_ab  # noqa: E402


def test_set_names_a_module_constant_and_a_literal():
    from deepinfer_nvidia_sm100.kernels import moe

    assert constants_ab.parse_set("moe.ROUTE_GEMV_MAX_TOKENS=0") == (moe, "ROUTE_GEMV_MAX_TOKENS", 0)
    assert constants_ab.parse_set("moe.moe_route.appends_shared_experts=False") == (moe.moe_route, "appends_shared_experts", False)
    from deepinfer_nvidia_sm100 import deepgemm  # a provider module of the plugin, outside kernels/

    assert constants_ab.parse_set("deepgemm.MIN_PAIRS_PER_EXPERT=1000000000") == (deepgemm, "MIN_PAIRS_PER_EXPERT", 10**9)
    for bad, says in (("moe.ROUTE_GEMV_MAX_TOKENS", "MODULE.NAME=VALUE"), ("moe.NO_SUCH=1", "NO_SUCH is missing"),
                      ("moe.moe_route.no_such=1", "no_such is missing"), ("moe.=1", "MODULE.NAME=VALUE"),
                      ("moe.ROUTE_GEMV_MAX_TOKENS=zero", "Python literal"), ("nosuchmodule.X=1", "nosuchmodule")):
        with pytest.raises(SystemExit, match=says):
            constants_ab.parse_set(bad)


def test_drop_leaves_ops_out_of_their_module_tables_for_the_changed_side_only():
    from deepinfer_nvidia_sm100.kernels import cache, moe

    [(module, name, table)] = constants_ab.parse_drops(["norm_rope_write_latent"])
    assert (module, name) == (cache, "OPS")
    assert set(table) == set(cache.OPS) - {"norm_rope_write_latent"} and "norm_rope_write_latent" in cache.OPS
    with constants_ab.constants([(module, name, table)]):
        assert "norm_rope_write_latent" not in cache.OPS
    assert "norm_rope_write_latent" in cache.OPS  # put back
    # two ops of one module leave one table without both; another module's op its own table
    changed = constants_ab.parse_drops(["norm_rope_write_latent", "gather_latent_cache", "moe_route"])
    assert {m: set(t) for m, _, t in changed} == {cache: set(cache.OPS) - {"norm_rope_write_latent", "gather_latent_cache"},
                                                  moe: set(moe.OPS) - {"moe_route"}}
    with pytest.raises(SystemExit, match="no NVIDIA kernel module provides it"):
        constants_ab.parse_drops(["engram_gate"])  # V4.1, left to the reference (backend.LEFT_TO_REFERENCE)


def test_nothing_to_compare_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="give at least one --set"):
        constants_ab.main(["--out", str(tmp_path)])
