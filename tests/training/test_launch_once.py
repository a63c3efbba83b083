"""One launch resolves its sizes once and runs one agreement collective (`hf_upipe.training.parallelism.Launch`,
`hf_upipe.training.runtime.agree_on_launch`): counted over a UPipeTrainer's construction and first training step,
a `UPipePlugin.prepare`, a TRL trainer's (`UPipeSFTTrainer`'s construction and first step, `UPipeGRPOTrainer`'s
construction) and a `UPipeRuntime.setup` on 2 gloo ranks. What the later steps compared on their own
(the UPIPE_* environment, the settings init_sequence_parallel is asked for, the model prepare_model prepares) is
refused on every rank by that one agreement, with the same messages."""

import pytest

from tests._dist import run_distributed
from tests.training._launch_runs import launch_counts

pytestmark = pytest.mark.slow  # 2 processes, about 25 s on 2 busy cores


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    return run_distributed(launch_counts, 2, str(tmp_path_factory.mktemp("launch")), timeout=300)


@pytest.mark.parametrize("entry", ["trainer", "plugin", "sft", "grpo", "runtime"])
def test_one_agreement_and_one_resolution_per_launch(seen, entry):
    for rank in seen:
        counts = rank[entry]
        assert counts["agreement"] == 1, (
            counts
        )  # all_gather_object calls, the first training step included
        assert counts["with_parallelism_sp"] == 1 and counts["resolve_sp_size"] == 1, counts
        assert counts.get("find_parallelism", 0) == (entry != "runtime"), counts


def test_a_model_from_model_init_is_agreed_on_in_the_setup(seen):
    """Built inside Trainer.__init__, after the first agreement: the setup agrees on it (one more collective), and
    the model train() builds again from model_init is prepared with its own agreement (a third); the sizes are
    still resolved once."""
    for rank in seen:
        counts = rank["model_init"]
        assert counts["agreement"] == 3, counts
        assert counts["with_parallelism_sp"] == 1 and counts["resolve_sp_size"] == 1, counts


@pytest.mark.parametrize(
    "case, said",
    [
        ("environment", "The ranks have different UPIPE_* settings in their environment"),
        ("init", "The ranks asked init_sequence_parallel for different settings"),
        ("model", "The ranks of one SP group called prepare_model differently"),
    ],
)
def test_what_later_steps_compared_is_refused_by_the_one_agreement(seen, case, said):
    messages = [rank[case][0] for rank in seen]
    assert messages[0] == messages[1] and messages[0].startswith(said), messages
    for rank in seen:
        assert rank[case][1]["agreement"] == 1, rank[case]
