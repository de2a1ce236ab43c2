"""The key store on its own: a key is accepted only when its whole SHA-256 hash is stored.

Near misses matter here: a store that compared a prefix of the digest (or any part of it) would
accept a key whose stored hash differs from the real one in a single hex character.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.admission.keys import KeyStore
from modeldock.config import TenantConfig, hash_key
from modeldock.errors import Unauthorized

KEY = "md-live-3f9c1a7e5b2d4068"
HEX = "0123456789abcdef"


def near_miss(stored: str, position: int) -> str:
    """`stored` (sha256:<hex>) with the hex character at `position` replaced by another hex character."""
    prefix, digest = stored.split(":", 1)
    other = HEX[(HEX.index(digest[position]) + 1) % len(HEX)]
    return f"{prefix}:{digest[:position]}{other}{digest[position + 1:]}"


def tenant(tenant_id: str, *hashes: str) -> TenantConfig:
    return TenantConfig(id=tenant_id, api_key_hashes=list(hashes), models=["*"])


def test_near_miss_helper_changes_exactly_one_character() -> None:
    real = hash_key(KEY)
    for position in (0, 31, 63):
        changed = near_miss(real, position)
        assert len(changed) == len(real)
        assert [i for i, (a, b) in enumerate(zip(real, changed, strict=True)) if a != b] == [len("sha256:") + position]


def test_the_exact_key_is_accepted_and_names_its_tenant() -> None:
    store = KeyStore([tenant("acme", hash_key(KEY))])
    assert store.authenticate(KEY).id == "acme"


def test_stored_hash_differing_only_in_the_last_character_is_rejected() -> None:
    store = KeyStore([tenant("acme", near_miss(hash_key(KEY), 63))])
    with pytest.raises(Unauthorized) as info:
        store.authenticate(KEY)
    assert info.value.status == 401
    assert info.value.code == "invalid_api_key"
    assert KEY not in str(info.value)


@pytest.mark.parametrize("position", [0, 1, 7, 8, 15, 16, 31, 32, 48, 62, 63])
def test_stored_hash_differing_in_any_one_character_is_rejected(position: int) -> None:
    store = KeyStore([tenant("acme", near_miss(hash_key(KEY), position))])
    with pytest.raises(Unauthorized):
        store.authenticate(KEY)


def test_near_miss_does_not_shadow_the_real_key_of_another_tenant() -> None:
    # The near miss comes first and last: a store that stopped at (or kept) the wrong match would name "decoy".
    store = KeyStore([
        tenant("decoy", near_miss(hash_key(KEY), 63)),
        tenant("acme", hash_key(KEY)),
        tenant("decoy2", near_miss(hash_key(KEY), 0)),
    ])
    assert store.authenticate(KEY).id == "acme"


def test_each_of_a_tenants_keys_is_accepted_and_only_those() -> None:
    store = KeyStore([
        tenant("acme", hash_key("k-one"), hash_key("k-two")),
        tenant("other", hash_key("k-three")),
    ])
    assert store.authenticate("k-one").id == "acme"
    assert store.authenticate("k-two").id == "acme"
    assert store.authenticate("k-three").id == "other"
    for wrong in ("k-one ", "k-on", "K-ONE", "k-four"):
        with pytest.raises(Unauthorized):
            store.authenticate(wrong)


def test_the_hash_itself_is_not_a_key() -> None:
    store = KeyStore([tenant("acme", hash_key(KEY))])
    for wrong in (hash_key(KEY), hash_key(KEY).removeprefix("sha256:")):
        with pytest.raises(Unauthorized):
            store.authenticate(wrong)


def test_missing_key_is_rejected_with_a_message_saying_how_to_send_it() -> None:
    store = KeyStore([tenant("acme", hash_key(KEY))])
    with pytest.raises(Unauthorized) as info:
        store.authenticate("")
    assert str(info.value) == "Missing API key. Send it as `Authorization: Bearer <key>`."


def test_wrong_key_message_is_openais_and_names_no_key() -> None:
    with pytest.raises(Unauthorized) as info:
        KeyStore([tenant("acme", hash_key(KEY))]).authenticate("md-wrong")
    assert str(info.value) == "Incorrect API key provided."


def test_key_with_bytes_that_are_not_utf8_is_rejected_not_a_crash() -> None:
    # Header bytes that are not UTF-8 reach the store as surrogate escapes (extproc/flow.py); such a
    # key is hashed over its raw bytes, so it is rejected with 401 (or matched), never an exception.
    key = "md-\udcff\udcfe"
    store = KeyStore([tenant("acme", hash_key(KEY))])
    with pytest.raises(Unauthorized):
        store.authenticate(key)
    raw = "sha256:" + hashlib.sha256(b"md-\xff\xfe").hexdigest()
    assert KeyStore([tenant("acme", raw)]).authenticate(key).id == "acme"


def test_empty_store_accepts_nothing() -> None:
    with pytest.raises(Unauthorized):
        KeyStore([]).authenticate(KEY)


def test_non_ascii_key_is_hashed_as_utf8() -> None:
    key = "clé-ключ-鍵"
    store = KeyStore([tenant("acme", hash_key(key))])
    assert store.authenticate(key).id == "acme"
    with pytest.raises(Unauthorized):
        KeyStore([tenant("acme", near_miss(hash_key(key), 63))]).authenticate(key)


keys = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    key=keys,
    others=st.lists(keys, max_size=4),
    misses=st.lists(st.integers(min_value=0, max_value=63), max_size=4),
    include_real=st.booleans(),
    data=st.data(),
)
def test_a_key_is_accepted_only_when_its_full_hash_is_stored(
    key: str, others: list[str], misses: list[int], include_real: bool, data: st.DataObject
) -> None:
    real = hash_key(key)
    stored = [hash_key(o) for o in others] + [near_miss(real, p) for p in misses]
    if include_real:
        stored.append(real)
    stored = data.draw(st.permutations(stored))
    tenants = [tenant(f"t{i}", h) for i, h in enumerate(stored)]
    store = KeyStore(tenants)
    owners = {t.id for t in tenants if real in t.api_key_hashes}
    if owners:
        assert store.authenticate(key).id in owners
    else:
        with pytest.raises(Unauthorized):
            store.authenticate(key)
