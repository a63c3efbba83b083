"""Every model type whose modeling module picks attention classes from its own table refuses "upipe" by name.

The types are found in the installed transformers' sources (a module-level dict whose first key is an attention
implementation, as in `FALCON_ATTENTION_CLASSES = {"eager": ...}`), not listed by hand: a release that adds one is
swept too. Each is built from a config on the meta device (no weights), tiny where `hf_upipe.models.presets.tiny_config`
can make it, with attn_implementation="upipe".
"""

import glob
import os
import re

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import (
    CONFIG_MAPPING,
    CONFIG_MAPPING_NAMES,
    model_type_to_module_name,
)

import hf_upipe  # noqa: F401  (registers "upipe")
from hf_upipe.attention.registered import OwnAttentionTable, attention_tables
from hf_upipe.models.presets import tiny_config
from hf_upipe.models.verification import installed_release

_TABLE = re.compile(r'^\w+\s*=\s*\{\s*\n\s*"(?:eager|sdpa|flash_attention_2)"\s*:\s*[A-Z]', re.M)


def _table_files() -> list[str]:
    """'falcon.modeling_falcon', ...: the modeling files with such a table."""
    root = os.path.dirname(transformers.models.__file__)
    paths = glob.glob(os.path.join(root, "*", "modeling_*.py"))
    return sorted(
        ".".join(p[:-3].split(os.sep)[-2:]) for p in paths if _TABLE.search(open(p).read())
    )


FILES = _table_files()
MODULES = sorted({f.split(".")[0] for f in FILES})
TYPES = [t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) in MODULES]


def _config(model_type):
    try:
        return tiny_config(model_type)
    except Exception:  # noqa: BLE001  (gpt_neo's attention_types do not fit 2 layers: its default config)
        return CONFIG_MAPPING[model_type]()


def _build(model_type, implementation):
    """The model of `model_type` (causal LM, else the base model, else SuperGlue's kind) on the meta device; None
    if no auto class builds it (sub-configs such as 'sam_prompt_encoder')."""
    config = _config(model_type)
    for auto in (AutoModelForCausalLM, AutoModel, transformers.AutoModelForKeypointMatching):
        try:
            with torch.device("meta"):
                return auto.from_config(config, attn_implementation=implementation)
        except ValueError as err:
            if "Unrecognized configuration class" not in str(err):
                raise
    return None


# causal LMs known to pick their attention class from a table of their own; Falcon moved to transformers' attention
# interface in 5.25
KNOWN = ["gpt_neo", "git"] + (["falcon"] if installed_release() in ("5.23", "5.24") else [])


def test_the_sweep_finds_the_known_tables():
    assert set(KNOWN) <= set(MODULES)
    assert set(KNOWN) <= set(TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_upipe_is_refused_by_name_or_builds(model_type):
    try:
        model = _build(model_type, "upipe")
    except OwnAttentionTable as err:  # never transformers' bare KeyError: 'upipe'
        message = str(err)
        assert "attn_implementation='upipe' is not available for model_type" in message
        assert "_CLASSES" in message or "ATTENTION" in message, message
        assert "train without sequence parallelism" in message and "attn_implementation=" in message
        assert f"transformers.models.{model_type_to_module_name(model_type)}" in message, message
        return
    # built: its table is not on a "upipe" layer's path (an audio or text model beside a vision table)
    assert model is None or model.config._attn_implementation == "upipe"


@pytest.mark.parametrize("model_type", KNOWN)
def test_causal_lms_with_a_table_are_refused_and_build_otherwise(model_type):
    with pytest.raises(OwnAttentionTable, match=f"model_type '{model_type}'"):
        _build(model_type, "upipe")
    assert _build(model_type, "eager") is not None  # the entry refuses "upipe" only


def test_the_runtime_finds_the_tables_the_sources_show():
    import importlib

    for name in FILES:
        module = importlib.import_module(f"transformers.models.{name}")
        tables = attention_tables(module)
        assert tables, name
        assert all("eager" in table for table in tables.values()), name
