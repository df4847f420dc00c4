"""The model contract (models/contract.py) and the registry (models/registry.py): every
generation's class keeps the contract, a class that breaks it is refused naming what it lacks,
and model_type is read in one place."""

from __future__ import annotations

import pytest

from deepinfer_core.config import ConfigError
from deepinfer_core.models.contract import check_model_class
from deepinfer_core.models.registry import GENERATIONS, SUPPORTED_MODEL_TYPES, drafting, generation


@pytest.mark.parametrize("gen", GENERATIONS, ids=lambda g: g.name)
def test_every_generation_keeps_the_contract(gen):
    check_model_class(gen.model)
    assert gen.checkpoint_format is gen.model.checkpoint_format
    assert all(generation(t) is gen for t in gen.model_types)


def test_a_class_that_breaks_the_contract_is_refused_naming_what_it_lacks():
    base = GENERATIONS[0].model

    class NoGraphFlag(base):
        supports_graphs = None

    with pytest.raises(TypeError, match="supports_graphs must be a bool"):
        check_model_class(NoGraphFlag)

    class Streams(base):
        mtp_reads_streams = True  # without forward_streams / head_hidden

    with pytest.raises(TypeError, match=r"forward_streams\(\) is missing.*head_hidden\(\) is missing"):
        check_model_class(Streams)

    class Drafter(base):
        draft_method = "medusa"

    with pytest.raises(TypeError, match="draft_method must be one of"):
        check_model_class(Drafter)


def test_registry_lookup():
    assert SUPPORTED_MODEL_TYPES == ("deepseek_v3", "deepseek_v2", "deepseek_v4", "deepseek_v41")
    assert drafting("dspark") == ("deepseek_v41",) and "deepseek_v4" in drafting("mtp")
    with pytest.raises(ConfigError, match="supported model types: deepseek_v3"):
        generation("llama")
