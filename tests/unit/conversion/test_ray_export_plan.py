"""The export over Ray nodes without Ray (`megarl.conversion.ray_export`): the parts numbered node
after node, and a node that cannot see the checkpoint or the output named in the error."""
import pytest

from megarl.conversion.ray_export import assign_parts, check_visible, export_nodes


def test_parts_are_numbered_node_after_node():
    assert assign_parts([("a", 3), ("b", 1), ("c", 2)]) == [("a", (0, 1, 2)), ("b", (3,)), ("c", (4, 5))]
    with pytest.raises(ValueError, match="node b: 0 export parts"):
        assign_parts([("a", 1), ("b", 0)])


def test_a_node_that_cannot_see_the_checkpoint_or_the_output_is_named(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    with pytest.raises(FileNotFoundError, match=r"on node n1: .*ckpt/metadata.json is not visible there"):
        check_visible(str(ckpt), str(out), "node n1")
    (ckpt / "metadata.json").write_text("{}")
    check_visible(str(ckpt), str(out), "node n1")
    with pytest.raises(FileNotFoundError, match=r"on node n2: .*/gone is not visible there.*every node mounts"):
        check_visible(str(ckpt), str(tmp_path / "gone"), "node n2")


def test_without_ray_the_export_stays_on_this_machine():
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is running in this process")
    assert export_nodes() == []
