"""Regression tests: seed derivation is injective; columns keep every value as given."""
from sbloader.core.plan import epoch_seed_from, partition_seed
from sbloader.core.block import to_column


def test_epoch_seed_from_is_injective():
    # SeedSequence splits each int into a variable number of 32-bit words and
    # ignores trailing zero words, so (a + 2**32 * b, 0) collides with (a, b).
    assert epoch_seed_from(2**32, 0) != epoch_seed_from(0, 1)
    assert epoch_seed_from(5 + 2**32 * 3, 0) != epoch_seed_from(5, 3)


def test_partition_seed_is_injective():
    assert partition_seed(2**32, 0, 0) != partition_seed(0, 1, 0)
    e = epoch_seed_from(0, 0)
    assert partition_seed(e, 2**32, 0) != partition_seed(e, 0, 1)


def test_to_column_keeps_mixed_types():
    col = to_column([1, "a"])
    assert col[0] == 1 and col[1] == "a"


def test_to_column_keeps_trailing_nul_bytes():
    assert to_column([b"ab\x00", b"c"])[0] == b"ab\x00"
    assert to_column(["a\x00", "b"])[0] == "a\x00"
