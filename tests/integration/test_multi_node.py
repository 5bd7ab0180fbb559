"""Multi-node tensor parallelism simulated on loopback (issue 31): DSPARK with `--tp-size 2 --nnodes 2`, node 0 and
node 1 two server processes on this machine, serves greedy output identical to plain `--tp-size 1`.

Node 1 is a second server process (`--node-rank 1`) with its own port for the dummy health server SGLang starts
there; each node's only rank sees gpu_id 0, so each process is bound to its own core (SGLANG_CPU_OMP_THREADS_BIND).
The two ranks use both of CI's cores: this module runs alone (its own module, so test_tensor_parallel.py's servers
have stopped).
"""

import pytest

from conftest import dspark_spec
from sgl_dspark.tools.launch import serving_two_nodes
from sgl_dspark.tools.models import SHIPPED_DRAFTER
from test_dspark_lossless import mismatches
from test_tensor_parallel import SUBSET, TP, greedy

pytestmark = pytest.mark.integration

NODES = SUBSET[:3]


@pytest.fixture(scope="module")
def two_node_replies(default_model_path, prompts, plain_reference, tmp_path_factory) -> list[dict]:
    spec = dspark_spec(default_model_path, str(SHIPPED_DRAFTER), *TP, gate=True)
    with serving_two_nodes(spec, tmp_path_factory.mktemp("dspark-two-nodes")) as (node0, _):
        return greedy(node0, prompts, NODES)


def test_dspark_on_two_nodes_is_greedy_identical_to_plain(two_node_replies, plain_reference):
    assert not mismatches(two_node_replies, [plain_reference[i] for i in NODES], NODES)
    assert sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in two_node_replies) > 0  # drafts accepted
