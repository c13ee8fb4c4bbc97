"""The per-page content identity (engine_hooks/page_identity.py): its definition, what it
depends on, and the switch."""

from array import array

import numpy as np
import pytest
import xxhash

from kvguard.engine_hooks.page_identity import IDENTITY_ENV, PageIdentity, enabled_from_env, token_array


def reference(tokens, page_size: int, salt: int) -> list[int]:
    """The definition in plain Python (docs/wire-format.md): id_k over id_{k-1} and page k's tokens."""
    ids, prev = [], 0
    for k in range(len(tokens) // page_size):
        page = tokens[k * page_size : (k + 1) * page_size]
        blob = prev.to_bytes(8, "little") + b"".join(int(t).to_bytes(4, "little", signed=True) for t in page)
        prev = xxhash.xxh3_64_intdigest(blob, seed=salt)
        ids.append(prev)
    return ids


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_the_chain_is_the_definition_and_covers_full_pages_only(page_size):
    tokens = np.random.default_rng(page_size).integers(0, 150_000, 3 * page_size + page_size // 2 + 1)
    ident = PageIdentity(page_size, salt=0x1234)
    got = ident.chain(tokens, 0, 100)  # asks for more pages than are full: only full ones come back
    assert got.dtype == np.uint64
    assert got.tolist() == reference(tokens.tolist(), page_size, 0x1234)
    assert len(got) == len(tokens) // page_size


def test_a_chain_continued_from_its_tip_equals_the_chain_from_zero():
    tokens = np.arange(40)
    ident = PageIdentity(4, salt=7)
    whole = ident.chain(tokens, 0, 10)
    head = ident.chain(tokens, 0, 3)
    tail = ident.chain(tokens, 3, 10, prev=int(head[-1]))
    assert np.concatenate((head, tail)).tolist() == whole.tolist()


def test_the_id_depends_on_the_whole_prefix_the_position_and_the_salt():
    ident = PageIdentity(4, salt=7)
    base = np.arange(100, 116)
    ids = ident.chain(base, 0, 4)
    earlier = base.copy()
    earlier[0] += 1  # another prefix: every later page differs, though its own tokens do not
    assert (ident.chain(earlier, 0, 4) != ids).all()
    # the same four tokens at another position give another id
    shifted = np.concatenate((base[4:8], base[4:8]))
    assert ident.chain(shifted, 0, 2)[0] != ids[1]
    assert (PageIdentity(4, salt=8).chain(base, 0, 4) != ids).all()  # another engine process
    assert PageIdentity(4).chain(base, 0, 1)[0] != PageIdentity(4).chain(base, 0, 1)[0]  # drawn per process


def test_token_array_views_sglangs_arrays_without_copying_and_appends_the_output():
    prompt, output = array("q", range(10)), array("q", [50, 51])
    view = token_array(prompt, output, 8)
    assert view.tolist() == list(range(8)) and np.shares_memory(view, np.frombuffer(prompt, np.int64))
    assert token_array(prompt, output, 12).tolist() == list(range(10)) + [50, 51]
    assert token_array([1, 2, 3]).tolist() == [1, 2, 3]  # a list (a stand-in) too


@pytest.mark.parametrize("raw,on", [("", False), ("0", False), ("off", False), ("1", True), ("ON", True)])
def test_the_switch(raw, on):
    assert enabled_from_env(raw) is on


def test_a_bad_switch_value_fails_naming_the_variable():
    with pytest.raises(ValueError, match=IDENTITY_ENV):
        enabled_from_env("maybe")
