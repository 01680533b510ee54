"""Compressor properties: unbiasedness, variance, contraction, determinism, wire format, bit counts."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from collab.compression import (
    CompressedMessage,
    Identity,
    MessageFormatError,
    MessageKind,
    RandK,
    TopK,
    index_bits,
    make_compressor,
    random_subset,
    topk_indices,
)


def _x(d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def test_randk_is_unbiased_and_variance_matches_omega() -> None:
    d, ratio, draws = 50, 0.1, 20000
    x = _x(d)
    q = RandK(ratio=ratio)
    samples = torch.stack([q.compress(x, seed=3, step=s).decompress() for s in range(draws)]).double()
    mean = samples.mean(0)
    # Each coordinate is (d/k) x_i with prob k/d: std of the mean = |x_i| sqrt(d/k - 1) / sqrt(draws).
    se = x.double().abs() * math.sqrt(q.omega(d)) / math.sqrt(draws)
    assert torch.all((mean - x.double()).abs() <= 5 * se + 1e-12)
    err = ((samples - x.double()) ** 2).sum(1).mean()
    expected = q.omega(d) * float((x.double() ** 2).sum())  # Rand-k meets the bound with equality
    assert abs(float(err) / expected - 1) < 0.05
    assert q.omega(d) == pytest.approx(d / q.k_of(d) - 1)


def test_randk_coordinates_are_uniform_distinct_and_sorted() -> None:
    d, k = 40, 7
    counts = np.zeros(d)
    for step in range(4000):
        idx = random_subset(11, step, d, k)
        assert idx.size == k and np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < d
        counts[idx] += 1
    expected = 4000 * k / d
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 90, chi2  # 39 degrees of freedom: p < 1e-5 above 90


def test_randk_complement_path_and_edges() -> None:
    d = 1000
    for k in (1, 499, 500, 501, 900, 999, 1000):
        idx = random_subset(5, 9, d, k)
        assert idx.size == k and len(set(idx.tolist())) == k
    with pytest.raises(ValueError):
        random_subset(0, 0, 10, 11)


def test_randk_same_seed_step_same_coordinates_in_another_process() -> None:
    here = random_subset(1234, 56, 1_000_003, 10_000)
    code = (
        "from collab.compression import random_subset; import hashlib;"
        "print(hashlib.sha256(random_subset(1234, 56, 1_000_003, 10_000).tobytes()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(here.tobytes()).hexdigest()
    assert not np.array_equal(here, random_subset(1234, 57, 1_000_003, 10_000))


def test_topk_satisfies_contraction_and_keeps_largest() -> None:
    for seed in range(20):
        d = 300
        x = _x(d, seed) * torch.rand(d, generator=torch.Generator().manual_seed(seed + 100))
        c = TopK(ratio=0.1)
        msg = c.compress(x)
        err = float(((msg.decompress() - x) ** 2).sum())
        assert err <= (1 - c.delta(d)) * float((x**2).sum()) + 1e-9
        kept = x.abs()[msg.indices]
        dropped = torch.ones(d, dtype=torch.bool)
        dropped[msg.indices] = False
        assert kept.min() >= x.abs()[dropped].max()


def test_topk_breaks_ties_by_lower_index() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.5])
    idx = TopK(ratio=4 / 7).compress(x).indices
    assert idx.tolist() == [1, 2, 3, 4]


def _reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Plain reference: sort by (-|x|, index) and keep the first k."""
    a = x.abs().numpy()
    order = np.lexsort((np.arange(a.size), -a))[:k]
    return torch.from_numpy(np.sort(order))


@pytest.mark.parametrize("d,k", [(1 << 19, 5000), (1 << 19, 30), (1 << 18, 1)])
def test_topk_sampled_threshold_path_is_exact(d: int, k: int) -> None:
    x = _x(d, 7)
    x[100:200] = 2.5  # a block of ties near the threshold region
    assert torch.equal(topk_indices(x, k), _reference_topk(x, k))


def test_topk_on_heavy_ties_matches_reference() -> None:
    x = torch.randint(-3, 4, (1 << 19,), generator=torch.Generator().manual_seed(1)).float()
    assert torch.equal(topk_indices(x, 1000), _reference_topk(x, 1000))


@pytest.mark.parametrize("comp", [Identity(), RandK(ratio=0.05), TopK(ratio=0.05), RandK(ratio=1.0)])
def test_serialization_roundtrips_bit_exactly(comp) -> None:  # type: ignore[no-untyped-def]
    x = _x(2000, 3)
    msg = comp.compress(x, seed=9, step=4)
    data = msg.to_bytes()
    back = CompressedMessage.from_bytes(data)
    assert back.kind == msg.kind and back.numel == msg.numel
    assert back.values.numpy().tobytes() == msg.values.numpy().tobytes()
    assert torch.equal(back.decompress(), msg.decompress())
    assert back.to_bytes() == data


@pytest.mark.parametrize("comp", [Identity(), RandK(ratio=0.05), TopK(ratio=0.05)])
def test_wire_pieces_join_to_the_bytes_and_shared_parsing_is_zero_copy(comp) -> None:  # type: ignore[no-untyped-def]
    msg = comp.compress(_x(3000, 5), seed=2, step=7)
    data = msg.to_bytes()
    assert b"".join(msg.to_buffers()) == data
    writable = bytearray(data)
    shared = CompressedMessage.from_bytes(writable, share=True)
    writable[-4:] = np.float32(123.0).tobytes()  # the values are a view of the buffer
    assert float(shared.values[-1]) == 123.0
    copied = CompressedMessage.from_bytes(bytearray(data))  # without share: a copy
    read_only = CompressedMessage.from_bytes(data, share=True)  # bytes cannot be shared: a copy
    assert copied.to_bytes() == read_only.to_bytes() == data


def test_a_dense_message_from_its_pieces() -> None:
    from collab.compression.message import DENSE_HEAD_BYTES

    msg = Identity().compress(_x(100, 1), seed=0, step=3)
    data = msg.to_bytes()
    values = torch.from_numpy(np.frombuffer(bytearray(data[DENSE_HEAD_BYTES:]), dtype="<f4"))
    back = CompressedMessage.dense_from_pieces(data[:DENSE_HEAD_BYTES], values)
    assert back.to_bytes() == data and back.values is values
    sparse = TopK(ratio=0.1).compress(_x(100, 1), seed=0, step=3).to_bytes()
    for head, vals in [
        (data[: DENSE_HEAD_BYTES - 1], values),  # short header
        (data[:DENSE_HEAD_BYTES], values[:-1]),  # fewer values than the header says
        (sparse[:DENSE_HEAD_BYTES], values),  # not a dense message's header
        (b"XX" + data[2:DENSE_HEAD_BYTES], values),  # bad magic
    ]:
        with pytest.raises(MessageFormatError):
            CompressedMessage.dense_from_pieces(head, vals)


def test_blocked_mean_and_norm_equal_the_whole_vector_formulas() -> None:
    """The average and the norm of large messages run block by block: the same bits as the formula over
    whole vectors (float64 zeros, each weighted add in order, one division, one rounding)."""
    from collab.compression import weighted_mean
    from collab.compression.aggregate import MEAN_BLOCK
    from collab.compression.validate import NORM_BLOCK, norm_of

    d = 2 * max(MEAN_BLOCK, NORM_BLOCK) + 12345  # several blocks and a ragged last one
    xs = [_x(d, i) * torch.logspace(-20, 20, d) for i in range(3)]
    xs[1][:10] = -0.0
    weights = [1.0, 0.37, 2.5e3]
    mean = weighted_mean([CompressedMessage(MessageKind.DENSE, d, x) for x in xs], weights)
    acc = torch.zeros(d, dtype=torch.float64)
    for x, w in zip(xs, weights, strict=True):
        acc.add_(x.double(), alpha=w)
    expected = (acc / sum(weights)).float()
    assert mean.values.numpy().tobytes() == expected.numpy().tobytes()
    norm = norm_of(CompressedMessage(MessageKind.DENSE, d, xs[0]))
    assert norm == pytest.approx(float(torch.linalg.vector_norm(xs[0].double())), rel=1e-12)


def test_wire_size_is_near_ideal() -> None:
    d = 100_000
    x = _x(d)
    header = 38
    assert len(RandK(ratio=0.01).compress(x, seed=1, step=1).to_bytes()) == header + 4 * 1000
    # Top-k: indices as LEB128 gaps (average gap 100 -> at most 2 bytes each) after an 8-byte length
    assert len(TopK(ratio=0.01).compress(x).to_bytes()) <= header + 8 + 4 * 1000 + 2 * 1000
    assert len(Identity().compress(x).to_bytes()) == header + 4 * d


def test_bit_counts_match_formula() -> None:
    d = 1000
    x = _x(d)
    assert Identity().compress(x).bits == 32 * d
    assert RandK(ratio=0.1).compress(x, seed=0, step=0).bits == 32 * 100  # indices free (shared seed)
    assert index_bits(d) == 10
    assert TopK(ratio=0.1).compress(x).bits == 100 * (32 + 10)


def test_constants() -> None:
    assert TopK(ratio=0.25).delta(100) == 0.25
    assert Identity().omega(10) == 0 and Identity().delta(10) == 1
    with pytest.raises(NotImplementedError):
        TopK(ratio=0.5).omega(10)
    with pytest.raises(ValueError):
        RandK(ratio=0)
    with pytest.raises(ValueError):
        make_compressor("gzip")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:10],
        lambda b: b"XX" + b[2:],
        lambda b: b[:2] + bytes([9]) + b[3:],
        lambda b: b[:3] + bytes([7]) + b[4:],
        lambda b: b + b"\0",
    ],
)
def test_malformed_bytes_are_rejected(mutate) -> None:  # type: ignore[no-untyped-def]
    data = TopK(ratio=0.1).compress(_x(100)).to_bytes()
    with pytest.raises(MessageFormatError):
        CompressedMessage.from_bytes(mutate(data))


def test_unsorted_or_out_of_range_indices_are_rejected() -> None:
    msg = TopK(ratio=0.1).compress(_x(100))
    bad = CompressedMessage(MessageKind.SPARSE, 100, msg.values, msg.indices.flip(0))  # type: ignore[union-attr]
    with pytest.raises(MessageFormatError):
        CompressedMessage.from_bytes(bad.to_bytes())
    big = CompressedMessage(MessageKind.SPARSE, 50, msg.values[:2], torch.tensor([3, 70]))
    with pytest.raises(MessageFormatError):
        CompressedMessage.from_bytes(big.to_bytes())


def test_compressors_reject_non_float32() -> None:
    with pytest.raises(TypeError):
        TopK(ratio=0.5).compress(torch.ones(4, dtype=torch.float64))


def test_topk_with_reused_work_buffers_is_exact() -> None:
    c = TopK(ratio=0.01)
    for seed in range(3):  # the same instance reuses its buffers across calls
        x = _x(1 << 19, seed)
        msg = c.compress(x)
        assert torch.equal(msg.indices, _reference_topk(x, c.k_of(x.numel())))  # type: ignore[arg-type]


def test_index_gap_coding_roundtrip_and_rejects_garbage() -> None:
    from collab.compression.message import decode_gaps, encode_gaps

    rng = np.random.default_rng(0)
    for idx in (
        np.array([0]),
        np.array([3, 200, 70_000, 2**40]),
        np.sort(rng.choice(10**7, 5000, replace=False)),
    ):
        assert np.array_equal(decode_gaps(encode_gaps(idx), idx.size), idx)
    with pytest.raises(MessageFormatError):
        decode_gaps(bytes([0x80, 0x80]), 1)  # unterminated varint
    with pytest.raises(MessageFormatError):
        decode_gaps(bytes([1, 2, 3]), 2)  # count mismatch
    with pytest.raises(MessageFormatError):
        decode_gaps(bytes([0xFF] * 12 + [1]), 1)  # longer than any 64-bit value


def test_clipping_scales_long_parts_to_the_bound_part_by_part() -> None:
    """Parts over ``ratio`` times the lower median come down to that norm; the others, members tagging
    along (weight 0) and a zero median are left alone; a sparse message is clipped per coordinate range,
    as the swarm's owners cut it."""
    from collab.compression.clip import PartClipping, clip_factors, clipped_norm
    from collab.compression.partition import split
    from collab.compression.validate import norm_of

    assert clip_factors({0: 1.0, 1: 2.0, 2: 50.0}, 10.0) == {2: 20.0 / 50.0}
    assert clipped_norm({0: 1.0, 1: 2.0, 2: 50.0}, 10.0) == {0: 1.0, 1: 2.0, 2: 20.0}
    assert clip_factors({0: 0.0, 1: 0.0, 2: 5.0}, 10.0) == {}, "a zero median says nothing about scale"
    d, n = 1000, 3
    gen = torch.Generator().manual_seed(3)
    msgs = [TopK(ratio=0.1).compress(torch.randn(d, generator=gen)) for _ in range(n)]
    long_ = msgs[2].values.clone()
    long_[msgs[2].indices < 100] *= 40.0  # long only in part 0 (coordinates [0, 334))
    msgs[2] = CompressedMessage(msgs[2].kind, d, long_, msgs[2].indices)
    clip = PartClipping(ratio=10.0, single_owner_bytes=0, shared_seed=0)
    out = clip.clip(msgs, [1.0, 1.0, 1.0])
    assert out[0] is msgs[0] and out[1] is msgs[1]
    before, after = split(msgs[2], n), split(out[2], n)
    bound = 10.0 * sorted(norm_of(split(m, n)[0]) for m in msgs)[1]
    assert norm_of(after[0]) == pytest.approx(bound, rel=1e-6) and norm_of(before[0]) > bound
    assert all(torch.equal(b.values, a.values) for b, a in zip(before[1:], after[1:], strict=True))
    assert clip.clip(msgs, [1.0, 1.0, 0.0])[2] is msgs[2], "a member tagging along is not compared"
