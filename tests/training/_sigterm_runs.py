"""Rank 1 of 2 under torchrun's environment (TORCHELASTIC_RUN_ID set), with hf_upipe's peer watch and its SIGTERM
hold (`hf_upipe.training.peers`), as one process: `python -m tests.training._sigterm_runs CASE OUT`. The process
hosts the store; a thread plays rank 0, beating its heartbeat. OUT holds a finished checkpoint
(`OUT/checkpoint-3`). It prints `sigterm <time.time()>` just before it sends itself SIGTERM, as torchrun's agent
does to the survivors once a rank died, and `alive` once the signal returned. CASE:
- "named": inside a step (`peers.guarded`), rank 0 stops beating and SIGTERM arrives: held; the watch prints
  the line naming rank 0 and ends the process (status 1) within `UPIPE_PEER_TIMEOUT`;
- "held": inside a step, rank 0 still beating: held `_HOLD_S` seconds (UPIPE_TEST_HOLD_S here), then status 143;
- "outside": outside a step: status 143 at once, as SIGTERM ends a process under torchrun.
"""

import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from hf_upipe.training import peers


def main(case: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    beating = threading.Event()
    beating.set()

    def rank0():
        while beating.is_set():
            store.add(f"{peers._PREFIX}/beat/0", 1)
            time.sleep(0.05)

    threading.Thread(target=rank0, daemon=True).start()
    watch = peers._Watch(store, 1, 2, peers.peer_timeout())
    peers._WATCH["watch"] = watch
    watch.resume_dir = out
    peers._hold_launcher_stop(watch)  # what start_watch does once it has a store
    peers._HOLD_S = float(os.environ.get("UPIPE_TEST_HOLD_S", peers._HOLD_S))
    time.sleep(3 * watch.interval)  # the watch has seen rank 0 beat
    with peers.guarded(None) if case != "outside" else _nothing():
        if case == "named":
            beating.clear()
        print("sigterm", repr(time.time()), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("alive", flush=True)
        time.sleep(60)
    print("not ended", flush=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
