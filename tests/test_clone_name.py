"""The suite and the package work wherever the repository is cloned, whatever the folder's name: what counts as
hf_upipe's own code is decided by the package's folder, not by a path that merely contains "hf_upipe"."""

import importlib.util

import pytest

from hf_upipe.exits import is_setting_error, raised_in_hf_upipe
from hf_upipe.tools.selftest import raised_by_hf_upipe


def _raise_from(path) -> BaseException:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("def refuse():\n    raise ValueError('a user script of its own')\n")
    spec = importlib.util.spec_from_file_location("users_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError) as info:
        module.refuse()
    return info.value


def test_a_user_file_in_a_folder_named_hf_upipe_is_not_hf_upipe_code(tmp_path):
    for path in (
        tmp_path / "hf_upipe" / "train.py",
        tmp_path / "hf_upipe" / "tests" / "hf_upipe" / "x.py",
    ):
        err = _raise_from(path)
        assert (
            not raised_in_hf_upipe(err)
            and not is_setting_error(err)
            and not raised_by_hf_upipe(err)
        )


def test_hf_upipes_own_refusal_is_its_own():
    from hf_upipe.ops.head_layout import HeadLayout

    with pytest.raises(ValueError) as info:
        HeadLayout(num_heads=6, num_kv_heads=2, sp_size=4)
    assert (
        raised_in_hf_upipe(info.value)
        and is_setting_error(info.value)
        and raised_by_hf_upipe(info.value)
    )
