import json

import pytest
import torch
from safetensors.torch import save

from kvmem.errors import BlobError, InvalidInputError
from kvmem.kv.blob import KVBlob, checksum, decode_blob, encode_blob
from kvmem.kv.codec import bytes_per_token, encode, role_codecs
from kvmem.kv.store import KVStore

FP = "a" * 64


def make_blob(fact_id="f1", tokens=5, fp=FP, seed=0, codec="none", position=7):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(4, tokens, 3, 8, generator=g).to(torch.bfloat16)  # [L, T, H, D] as cached
    value = torch.randn(4, tokens, 3, 8, generator=g).to(torch.bfloat16)
    keys, values = role_codecs(codec)
    return KVBlob(fact_id, fp, tuple(range(100, 100 + tokens)), encode(key, keys), encode(value, values), position)


def test_round_trip_is_exact():
    blob = make_blob()
    back = decode_blob(encode_blob(blob), "f1", FP)
    assert back.token_ids == blob.token_ids and back.key_position == 7 and back.codec == "none"
    assert torch.equal(back.key, blob.key) and back.key.dtype == torch.bfloat16
    assert torch.equal(back.value, blob.value) and back.value.dtype == torch.bfloat16


def test_a_blob_is_as_large_as_the_cache_it_holds():
    blob = make_blob(tokens=20)
    assert blob.nbytes == 2 * 4 * 20 * 3 * 8 * 2  # K and V, bf16, nothing else
    assert len(encode_blob(blob)) < blob.nbytes + 1200  # + the header (token ids, checksum)


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4", "k8v4", "k4v8", "int7", "int6", "int4h", "k7v8"])
def test_coded_blobs_round_trip_their_parts_exactly(codec):
    blob = make_blob(codec=codec)
    back = decode_blob(encode_blob(blob), "f1", FP)
    assert back.codec == codec and back.key_position == 7
    for role in ("keys", "values"):
        mine, theirs = getattr(blob, role).parts, getattr(back, role).parts
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in mine)
    layers, tokens, heads, dim = blob.keys.shape
    assert torch.equal(back.key, blob.key) and blob.nbytes == tokens * bytes_per_token(codec, layers, heads, dim, 2)
    assert blob.nbytes < make_blob().nbytes * 0.7  # D = 8: scales weigh more than at 64


def _format1_bytes(blob_id: str, key, value, token_ids, fp: str = FP) -> bytes:
    """A blob as kvmem wrote them before format 2: pre-RoPE float32 keys, no codec, no position."""
    tensors = {"key": key, "value": value}
    meta = {"kvmem_format": "1", "layout": "LTHD", "fact_id": blob_id, "fingerprint": fp,
            "num_tokens": str(len(token_ids)), "token_ids": json.dumps(list(token_ids)),
            "checksum_algo": "xxh3_128", "checksum": checksum(fp, tuple(token_ids), tensors)}
    return save(tensors, metadata=meta)


def test_format_1_blobs_still_load_with_their_pre_rope_keys():
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(4, 5, 3, 8, generator=g), torch.randn(4, 5, 3, 8, generator=g).to(torch.bfloat16)
    back = decode_blob(_format1_bytes("f1", key, value, range(5)), "f1", FP)
    assert back.key_position is None and back.codec == "none" and back.token_ids == tuple(range(5))
    assert torch.equal(back.key, key) and torch.equal(back.value, value)
    with pytest.raises(ValueError, match="format-1"):
        encode_blob(back)  # read, never written


def test_flipped_byte_is_corrupt():
    data = bytearray(encode_blob(make_blob()))
    data[-3] ^= 0x01
    with pytest.raises(BlobError) as e:
        decode_blob(bytes(data), "f1", FP)
    assert e.value.reason == BlobError.CORRUPT


def _rewrite_metadata(data: bytes, **changes) -> bytes:
    from safetensors.torch import load, save

    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + header_len])["__metadata__"]
    meta.update(changes)
    return save(load(data), metadata={k: v for k, v in meta.items() if v is not None})


def test_blobs_checksummed_with_blake2b_before_xxh3_still_load():
    blob = make_blob()
    tensors = {"key.data": blob.key, "value.data": blob.value}
    old = _rewrite_metadata(encode_blob(blob), checksum_algo=None,
                            checksum=checksum(FP, blob.token_ids, tensors, "blake2b"))
    assert torch.equal(decode_blob(old, "f1", FP).key, blob.key)
    flipped = bytearray(old)
    flipped[-3] ^= 0x01
    with pytest.raises(BlobError) as e:
        decode_blob(bytes(flipped), "f1", FP)
    assert e.value.reason == BlobError.CORRUPT


def test_unknown_checksum_algorithm_is_stale():
    with pytest.raises(BlobError) as e:
        decode_blob(_rewrite_metadata(encode_blob(make_blob()), checksum_algo="md4"), "f1", FP)
    assert e.value.reason == BlobError.STALE


def test_truncated_file_is_corrupt():
    with pytest.raises(BlobError) as e:
        decode_blob(encode_blob(make_blob())[:100], "f1", FP)
    assert e.value.reason == BlobError.CORRUPT


def test_other_fingerprint_is_stale():
    with pytest.raises(BlobError) as e:
        decode_blob(encode_blob(make_blob(fp="b" * 64)), "f1", FP)
    assert e.value.reason == BlobError.STALE


def test_blob_of_another_fact_is_refused():
    with pytest.raises(BlobError):
        decode_blob(encode_blob(make_blob("f2")), "f1", FP)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="token ids"):
        KVBlob("f", FP, (1, 2), torch.zeros(1, 3, 1, 2), torch.zeros(1, 3, 1, 2))


def test_store_put_get_delete(tmp_path):
    store = KVStore(tmp_path, FP)
    blob = make_blob()
    store.put(blob)
    assert torch.equal(store.get("f1").key, blob.key)
    assert not list(store.dir.glob(".*")), "temp files left behind"
    assert store.delete("f1") and not store.exists("f1")
    with pytest.raises(BlobError) as e:
        store.get("f1")
    assert e.value.reason == BlobError.MISSING


def test_store_never_serves_a_rewritten_file_from_its_hot_cache(tmp_path):
    store = KVStore(tmp_path, FP)
    store.put(make_blob(seed=1))
    store.get("f1")  # now hot
    other = KVStore(tmp_path, FP)  # e.g. the worker process rewriting the blob
    other.put(make_blob(seed=2))
    assert torch.equal(store.get("f1").key, make_blob(seed=2).key)


def test_store_refuses_foreign_fingerprints_and_bad_ids(tmp_path):
    store = KVStore(tmp_path, FP)
    with pytest.raises(BlobError):
        store.put(make_blob(fp="c" * 64))
    for bad in ["", "../x", ".hidden", "a/b", "x" * 200]:
        with pytest.raises(InvalidInputError):
            store.path(bad)


def test_token_ids_check_agrees_with_a_full_decode(tmp_path):
    store = KVStore(tmp_path, FP)
    store.put(make_blob(tokens=7))
    assert store.token_ids("f1") == make_blob(tokens=7).token_ids
    assert not store._hot, "a check must not keep tensors"
    path = store.path("f1")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the value tensor: only the checksum over the raw bytes sees it
    path.write_bytes(bytes(data))
    for check in (store.token_ids, KVStore(tmp_path, FP).get):
        with pytest.raises(BlobError) as e:
            check("f1")
        assert e.value.reason == BlobError.CORRUPT
    KVStore(tmp_path, FP).put(make_blob(tokens=3))  # rewritten by another process
    assert store.token_ids("f1") == make_blob(tokens=3).token_ids
    store.delete("f1")
    with pytest.raises(BlobError) as e:
        store.token_ids("f1")
    assert e.value.reason == BlobError.MISSING


def test_header_check_finds_empty_truncated_swapped_and_foreign_files(tmp_path):
    store = KVStore(tmp_path, FP)
    for i, fact_id in enumerate(["ok", "empty", "short", "swapped", "other"]):
        store.put(make_blob(fact_id, seed=i))
    store.path("empty").write_bytes(b"")
    store.path("short").write_bytes(store.path("short").read_bytes()[:-3])
    store.path("swapped").write_bytes(store.path("ok").read_bytes())
    KVStore(tmp_path, "b" * 64).put(make_blob("other", fp="b" * 64))  # another model's blob
    store.path("other").write_bytes(KVStore(tmp_path, "b" * 64).path("other").read_bytes())
    assert [f for f in ["ok", "empty", "short", "swapped", "other", "never"] if store.intact(f)] == ["ok"]


def test_a_blobs_codec_is_read_from_its_own_header(tmp_path):
    """What a fact's page shows: the codec its blob was written with, whatever is configured now."""
    store = KVStore(tmp_path, FP)
    store.put(make_blob("plain"))
    store.put(make_blob("coded", codec="int8"))
    store.path("empty").write_bytes(b"")
    assert [store.codec(f) for f in ("plain", "coded", "empty", "never")] == ["none", "int8", None, None]
