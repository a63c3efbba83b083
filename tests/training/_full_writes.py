"""One process of `tests/training/test_full_disk.py`'s writer test: `python -m tests.training._full_writes DIR`,
where DIR is a small tmpfs. Each writer a save uses fills it for real (torch.save, safetensors' save_file, a Python
file write); then torch.save fails with space left (its target's folder is missing). Prints one JSON line:
{writer: [type of the error, whether `out_of_space` says the disk is full]}.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from hf_upipe.training.save_errors import out_of_space


def _write_file(path: str, tensor) -> None:
    with open(path, "wb") as f:
        f.write(tensor.numpy().tobytes())


def main(folder: str) -> None:
    big = {"w": torch.randn(1 << 20)}  # 4 MiB: more than the tmpfs holds
    writers = {
        "torch.save": lambda p: torch.save(big, p),
        "safetensors": lambda p: save_file(big, p),
        "python write": lambda p: _write_file(p, big["w"]),
    }
    seen = {}
    for name, write in writers.items():
        path = os.path.join(folder, "file")
        try:
            write(path)
            seen[name] = ["no error", False]
        except Exception as err:  # noqa: BLE001
            seen[name] = [type(err).__name__, out_of_space(err, path)]
        if os.path.exists(path):
            os.remove(path)
    path = os.path.join(folder, "missing", "file")
    try:
        torch.save(big, path)
    except Exception as err:  # noqa: BLE001
        seen["torch.save, no folder"] = [type(err).__name__, out_of_space(err, path)]
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])
