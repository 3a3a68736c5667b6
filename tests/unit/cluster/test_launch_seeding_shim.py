"""The CPU seeding shim's hash and sampler against an independent pure-Python MurmurHash3."""
import importlib.util

import torch

from megarl.cluster.ray_engines import SEEDING_SHIM_DIR


def _shim():
    spec = importlib.util.spec_from_file_location("megarl_seeding_shim", SEEDING_SHIM_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs nothing without MEGARL_SEEDED_SAMPLING=1
    return module


def _murmur3_x86_32(blocks):
    """Reference: MurmurHash3_x86_32 over 32-bit blocks, seed 0, length 4 * len(blocks)."""
    m32 = 0xFFFFFFFF
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & m32  # noqa: E731
    h = 0
    for k in blocks:
        k = rotl((k * 0xCC9E2D51) & m32, 15) * 0x1B873593 & m32
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m32
    h ^= 4 * len(blocks)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m32
    return h ^ (h >> 16)


def test_hash_matches_murmur3():
    shim = _shim()
    seeds, positions, cols = torch.tensor([0, 1, 2**62 + 12345]), torch.tensor([0, 17, 4096]), torch.arange(7)
    got = shim.murmur_hash32(seeds, positions, cols)
    expected = [[_murmur3_x86_32([int(s) & 0xFFFFFFFF, int(s) >> 32, int(p), int(c)]) for c in cols]
                for s, p in zip(seeds, positions)]
    assert got.tolist() == expected


def test_seeded_sampler_is_deterministic_and_follows_the_distribution():
    shim = _shim()
    logprobs = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1), dim=-1)
    seeds, positions = torch.arange(4000), torch.full((4000,), 3)
    first = shim.multinomial_with_seed(logprobs, seeds, positions)
    assert torch.equal(first, shim.multinomial_with_seed(logprobs, seeds, positions))
    freq = torch.bincount(first.view(-1), minlength=4).double() / 4000
    assert torch.allclose(freq, logprobs[0].exp().double(), atol=0.03)  # Gumbel-max samples softmax
