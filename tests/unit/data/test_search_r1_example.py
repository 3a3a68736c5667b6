"""The search demonstration's copy pretraining data (examples/search_r1/make_model.py).

What the pretraining teaches is copying only; these tests check its batches against their
definition: every marked position holds a token that an earlier span of the same sequence shows
right after the same preceding token, unmarked positions are whatever was drawn, and nothing
outside the ordinary vocabulary appears.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


def _module():
    spec = importlib.util.spec_from_file_location("search_r1_make_model", REPO / "examples/search_r1/make_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_copy_batch_marks_exactly_the_tokens_that_copying_predicts():
    module = _module()
    vocab = list(range(5, 300))
    ids, mask = module.copy_batch(torch.Generator().manual_seed(3), 16, 128, vocab, spans=3, span_min=4, span_max=24)
    assert ids.shape == mask.shape == (16, 128) and ids.dtype == torch.int64
    assert set(ids.unique().tolist()) <= set(vocab)
    for row, marks in zip(ids.tolist(), mask.tolist()):
        assert not any(marks[:64]), "copies are in the second half"
        runs, start = [], None
        for t, m in enumerate(marks + [False]):
            if m and start is None:
                start = t
            if not m and start is not None:
                runs.append((start, t))
                start = None
        assert 1 <= len(runs) <= 3 and all(4 <= b - a <= 24 for a, b in runs)
        for a, b in runs:  # the marker row[a-1] and the span row[a:b] occur earlier, in the first half
            copied = row[a - 1:b]
            assert any(row[s:s + len(copied)] == copied for s in range(0, 64 - len(copied) + 1)), (a, b)


def test_copy_batch_is_a_function_of_the_generator():
    module = _module()
    a = module.copy_batch(torch.Generator().manual_seed(7), 4, 64, list(range(100)))
    b = module.copy_batch(torch.Generator().manual_seed(7), 4, 64, list(range(100)))
    c = module.copy_batch(torch.Generator().manual_seed(8), 4, 64, list(range(100)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])


def test_the_shipped_model_copies_and_is_the_demo_architecture():
    """examples/search_r1/model (what the demo and CI train from) copies held-out spans it never saw
    (greedy accuracy >= 0.9 on the copied positions, transformers forward), and has the architecture
    and tokenizer that the arithmetic demo's make_model.py builds."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = _module()
    shipped = REPO / "examples/search_r1/model"
    record = json.loads((shipped / "copy_pretraining.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(shipped)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    accuracy = module.copy_accuracy(model, 32, 128, vocab, seed=record["seed"] + 1)  # batches it was not measured on
    assert accuracy >= 0.9, accuracy
    assert record["copy_accuracy"] >= 0.9, record
    config = json.loads((shipped / "config.json").read_text())
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 saves the latter
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], experts) == \
        ("qwen3_moe", 2, 64, 8), config
