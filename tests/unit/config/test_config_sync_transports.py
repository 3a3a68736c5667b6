"""Weight-sync transports are one registry (issue 36): ``weight_sync.transport`` takes a registered name,
``auto`` or an import path, validated like the losses; the cluster rules and the sync read what an
entry declares, not a transport's name."""
import sys

import pytest
from config_issues import validate_issues

from megarl.config.sync_transports import TRANSPORTS, TransportEntry, one_sender_per_stage, transport_entry

PLUGIN = '''
from megarl.config.sync_transports import TransportEntry, register_transport
from megarl.weight_sync.transport import Transport


class EchoTransport(Transport):
    name = "echo"


ECHO_ENTRY = TransportEntry(EchoTransport, delivers_shards=True, one_sender=True)


@register_transport("REGISTERED", colocated_only=True)
class SharedTransport(Transport):
    name = "shared"


def not_a_transport():
    pass
'''


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A module outside the package, importable from sys.path; its name. The registry is restored after."""
    saved = dict(TRANSPORTS)
    name = f"user_transports_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PLUGIN.replace("REGISTERED", f"{name}_shared"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    TRANSPORTS.clear()
    TRANSPORTS.update(saved)


def test_a_transport_by_import_path_validates_and_loads(good_overrides, plugin_module):
    spec = f"{plugin_module}:EchoTransport"
    assert validate_issues(good_overrides + [f"weight_sync.transport={spec}"]) == {}
    entry = TRANSPORTS.resolve(spec)
    assert entry.load() is sys.modules[plugin_module].EchoTransport
    assert not entry.delivers_shards and not one_sender_per_stage(spec)  # a bare class: the defaults
    declared = f"{plugin_module}:ECHO_ENTRY"  # an entry by import path: used as it is
    assert validate_issues(good_overrides + [f"weight_sync.transport={declared}"]) == {}
    assert TRANSPORTS.resolve(declared).delivers_shards and one_sender_per_stage(declared)


def test_unknown_names_are_refused_naming_the_field_and_the_registered_transports(good_overrides):
    issues = validate_issues(good_overrides + ["weight_sync.transport=carrier_pigeon"])
    assert list(issues) == ["weight_sync.transport"], issues
    message = issues["weight_sync.transport"]
    assert "weight_sync.transport='carrier_pigeon'" in message
    assert "'auto' or a registered weight-sync transport (disk, distributed, p2p, shard, tensor)" in message


@pytest.mark.parametrize("attr, message", [
    ("missing", "has no attribute 'missing'"),
    ("not_a_transport", "is neither a TransportEntry nor a transport class"),
])
def test_bad_import_paths_are_refused_naming_the_field(good_overrides, plugin_module, attr, message):
    issues = validate_issues(good_overrides + [f"weight_sync.transport={plugin_module}:{attr}"])
    assert message in issues.get("weight_sync.transport", ""), issues


def test_a_plugin_registers_a_transport_whose_declarations_the_rules_read(good_overrides, plugin_module):
    name = f"{plugin_module}_shared"
    assert "weight_sync.transport" in validate_issues(good_overrides + [f"weight_sync.transport={name}"])
    colocated = good_overrides + [f"plugins=[{plugin_module}]", f"weight_sync.transport={name}"]
    issues = validate_issues(colocated + ["cluster.placement=disaggregated"])
    assert "shares memory: it needs cluster.placement=colocated" in issues.get("weight_sync.transport", ""), issues
    assert transport_entry(name) == TransportEntry(sys.modules[plugin_module].SharedTransport, colocated_only=True)


def test_the_built_in_entries_name_their_classes_and_the_engines_loaders():
    from megarl.weight_sync.choice import engine_custom_weight_loaders
    from megarl.weight_sync.receiver import RECEIVER
    from megarl.weight_sync.sglang_transports import LOADER

    for name, entry in TRANSPORTS.items():
        assert entry.load().name == name  # the class's own name for itself
    assert TRANSPORTS["distributed"].load(unchecked=True).__name__ == "DistributedTransport"
    assert {n for n, e in TRANSPORTS.items() if e.delivers_shards} == {"p2p", "shard"}
    assert {n for n, e in TRANSPORTS.items() if e.one_sender} == {"shard", "tensor", "disk"}
    assert [engine_custom_weight_loaders(t) for t in ("auto", "p2p", "distributed", "shard", "tensor", "disk")] == [
        [LOADER, RECEIVER], [LOADER, RECEIVER], [RECEIVER], [LOADER], [], []]


def test_make_transport_builds_the_entrys_class_and_its_unchecked_fallback(monkeypatch, tmp_path, plugin_module):
    from types import SimpleNamespace

    from megarl.weight_sync import choice

    plan = SimpleNamespace(engine_layout=SimpleNamespace(tp_size=1))  # all a transport reads before connect()
    receiver = {"registered": True}
    monkeypatch.setattr(choice, "engines_have_receiver", lambda engines, timeout_s: receiver["registered"])
    built = {name: type(choice.make_transport(name, plan, [], directory=str(tmp_path))).__name__
             for name in ("p2p", "distributed", "shard", "tensor", "disk", f"{plugin_module}:EchoTransport")}
    assert built == {"p2p": "P2PTransport", "distributed": "CheckedDistributedTransport", "shard": "ShardTransport",
                     "tensor": "TensorTransport", "disk": "DiskTransport",
                     f"{plugin_module}:EchoTransport": "EchoTransport"}
    receiver["registered"] = False  # SGLang's own unchecked path, only for the entry that has one
    assert type(choice.make_transport("distributed", plan, [])).__name__ == "DistributedTransport"
    assert type(choice.make_transport("p2p", plan, [])).__name__ == "P2PTransport"
    with pytest.raises(ValueError, match="weight_sync.transport: unknown weight-sync transport 'carrier_pigeon'"):
        choice.make_transport("carrier_pigeon", plan, [])
