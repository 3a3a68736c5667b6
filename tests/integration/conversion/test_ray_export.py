"""The run's HF export spread over the nodes of a Ray cluster (issue 35 item 3).

A private 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, every raylet on
127.0.0.1, never another's cluster) and a TP1 dist checkpoint of the tiny Qwen3-MoE. The export the
driver runs (:class:`megarl.launch.hf_export.BackgroundExport`, its default export) sees two live
nodes and runs a part on each. The parts' node ids are read from what the node tasks returned (a spy
that calls the real :func:`megarl.conversion.ray_export.export_parts_on_nodes`); the reference is the
single-rank export on this machine (the safetensors library reads both). A node that cannot see the
output directory fails its part: the export is retried, then reported, never raised into the caller.
"""
import json
import logging

import pytest
import ray
import torch

from megarl.conversion import ray_export
from megarl.conversion.convert import hf_to_megatron, megatron_to_hf_dir
from megarl.conversion.hf_io import INDEX_FILE
from megarl.launch.hf_export import BackgroundExport
from megarl.testing.checkpoints import load_safetensors_dir
from megarl.testing.local_ray import private_ray_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # ~2 min on 2 shared cores: 2 raylets, 3 exports


@pytest.fixture(scope="module")
def two_nodes():
    """The ids of a private 2-node Ray cluster's nodes (one CPU each), this process connected to it."""
    with private_ray_cluster(head=dict(num_cpus=1), nodes=[dict(num_cpus=1)]):
        yield sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


@pytest.fixture(scope="module")
def ckpt(tiny_moe_dir, tmp_path_factory):
    """A TP1 dist checkpoint of the tiny Qwen3-MoE and its single-rank export on this machine."""
    work = tmp_path_factory.mktemp("ray_export")
    path = hf_to_megatron(tiny_moe_dir, work / "ckpt", timeout_s=240)
    return path, megatron_to_hf_dir(path, work / "hf_single", ranks=1, timeout_s=240)


class Spy:
    """Calls the real ``export_parts_on_nodes`` and records its results; ``break_output`` calls
    name an output directory no node sees (as if the run directory were not shared)."""

    def __init__(self, break_output: int = 0):
        self.real, self.break_output, self.results = ray_export.export_parts_on_nodes, break_output, []

    def __call__(self, nodes, ckpt_dir, out_dir, *args, **kwargs):
        if len(self.results) < self.break_output:
            out_dir = out_dir + "-not-mounted"
        self.results.append(None)
        self.results[-1] = self.real(nodes, ckpt_dir, out_dir, *args, **kwargs)
        return self.results[-1]


def test_the_run_export_writes_parts_on_both_nodes_as_the_single_rank_export(two_nodes, ckpt, tmp_path,
                                                                            monkeypatch):
    assert len(two_nodes) == 2 and sorted(ray_export.export_nodes()) == two_nodes
    spy = Spy()
    monkeypatch.setattr(ray_export, "export_parts_on_nodes", spy)
    export = BackgroundExport(ranks=1)  # the driver's export, one part per node
    export.start(ckpt[0], tmp_path / "hf" / "step_1")
    assert export.wait(raise_error=False) is None and export.failures == []
    (results,) = spy.results
    assert sorted(r.node_id for r in results) == two_nodes, "one part ran on each node"
    assert [r.index for r in results] == [0, 1]
    out = tmp_path / "hf" / "step_1"
    got, ref = load_safetensors_dir(out), load_safetensors_dir(ckpt[1])
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(ref), "the merged index names every tensor"
    files = sorted(f for r in results for f in r.part.files)
    assert sorted(set(weight_map.values())) == files == sorted(p.name for p in out.glob("*.safetensors"))
    assert (out / "config.json").is_file() and not list(out.parent.glob(".*tmp*"))


def test_a_failed_part_is_retried_and_reported_not_raised(two_nodes, ckpt, tmp_path, monkeypatch, caplog):
    spy = Spy(break_output=1)  # the first try's parts cannot see the output; the retry's can
    monkeypatch.setattr(ray_export, "export_parts_on_nodes", spy)
    export = BackgroundExport(ranks=1)
    with caplog.at_level(logging.ERROR, logger="megarl.train"):
        export.start(ckpt[0], tmp_path / "hf" / "step_1")  # returns: the export runs in its thread
        assert export.wait(raise_error=False) is None and export.failures == []
    assert len(spy.results) == 2 and spy.results[0] is None
    assert "try 1 of 2" in caplog.text and "is not visible there" in caplog.text and "HF export part on node" in caplog.text
    assert sorted(load_safetensors_dir(tmp_path / "hf" / "step_1")) == sorted(load_safetensors_dir(ckpt[1]))

    spy.break_output = 10  # every try fails: counted and handed back, training would go on
    export.start(ckpt[0], tmp_path / "hf" / "step_2")
    error = export.wait(raise_error=False)
    assert isinstance(error, FileNotFoundError) and "-not-mounted" in str(error)
    assert [name for name, _ in export.failures] == [ckpt[0].name] and not (tmp_path / "hf" / "step_2").exists()
