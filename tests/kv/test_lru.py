"""ByteLRU (kv/lru.py): the byte budget holds, the least recently used goes first."""

from kvmem.kv.lru import ByteLRU


def test_the_budget_evicts_the_least_recently_used_first():
    lru = ByteLRU(10)
    lru.put("a", 1, 4)
    lru.put("b", 2, 4)
    lru.touch("a")  # b is now the least recently used
    lru.put("c", 3, 4)
    assert lru.keys() == ["a", "c"] and lru.bytes == 8
    assert lru.get("b") is None and lru.get("a") == 1
    assert lru.keys() == ["a", "c"]  # get does not count as a use


def test_a_replaced_entry_is_counted_once_and_an_oversized_one_is_not_kept():
    lru = ByteLRU(10)
    lru.put("a", 1, 4)
    lru.put("a", 2, 6)
    assert lru.bytes == 6 and lru.get("a") == 2 and len(lru) == 1
    lru.put("huge", 3, 11)
    assert "huge" not in lru and lru.bytes == 6
    assert lru.pop("a") == 2 and lru.bytes == 0 and lru.pop("a") is None
    assert len(ByteLRU(0).keys()) == 0
