from clm_middleware.cache.hashing import chain_keys, extra_key_bytes, root_key

EXTRA = extra_key_bytes("model-a")


def test_same_tokens_same_prefix_give_same_keys():
    tokens = list(range(48))
    assert chain_keys(tokens, 16, EXTRA) == chain_keys(list(tokens), 16, EXTRA)


def test_same_block_after_a_different_prefix_gets_a_different_key():
    shared_tail = list(range(100, 116))
    first = chain_keys([1] * 16 + shared_tail, 16, EXTRA)
    second = chain_keys([2] * 16 + shared_tail, 16, EXTRA)
    assert first[0] != second[0]
    assert first[1] != second[1]


def test_partial_trailing_block_has_no_key():
    assert len(chain_keys(list(range(31)), 16, EXTRA)) == 1
    assert len(chain_keys(list(range(32)), 16, EXTRA)) == 2
    assert chain_keys(list(range(15)), 16, EXTRA) == []


def test_model_fingerprint_and_salt_change_every_key():
    tokens = list(range(32))
    plain = chain_keys(tokens, 16, EXTRA)
    other_model = chain_keys(tokens, 16, extra_key_bytes("model-b"))
    salted = chain_keys(tokens, 16, extra_key_bytes("model-a", "tenant-1"))
    assert not set(plain) & set(other_model)
    assert not set(plain) & set(salted)


def test_chain_can_resume_from_a_parent_key():
    tokens = list(range(64))
    whole = chain_keys(tokens, 16, EXTRA)
    resumed = chain_keys(tokens, 16, EXTRA, start_block=2, parent=whole[1])
    assert resumed == whole[2:]
    assert chain_keys(tokens, 16, EXTRA, num_blocks=3) == whole[:3]
    assert root_key(EXTRA) != root_key(extra_key_bytes("model-b"))
