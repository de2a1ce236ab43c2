"""The `redis+sentinel://` URL: what it parses to, and errors that say what is wrong without quoting it."""

from __future__ import annotations

import pytest

from modeldock.redis_client import SENTINEL_PORT, SentinelUrl, parse_sentinel_url

SECRET = "s3cr3t-sentinel-pw"


def test_every_part_of_a_sentinel_url_is_read() -> None:
    url = parse_sentinel_url(
        f"redis+sentinel://app:{SECRET}%2Fx@10.0.0.5:26380,sentinel-b,[fd00::7]:26381/mymaster/3"
        f"?sentinel_username=watch&sentinel_password=pw%40here"
    )
    assert url == SentinelUrl(
        sentinels=(("10.0.0.5", 26380), ("sentinel-b", SENTINEL_PORT), ("fd00::7", 26381)),
        master="mymaster", db=3, username="app", password=f"{SECRET}/x",
        sentinel_username="watch", sentinel_password="pw@here",
    )


def test_defaults_no_auth_db_0_and_a_trailing_slash() -> None:
    url = parse_sentinel_url("redis+sentinel://s1/mymaster/")
    assert (url.sentinels, url.master, url.db) == ((("s1", SENTINEL_PORT),), "mymaster", 0)
    assert url.username is url.password is url.sentinel_username is url.sentinel_password is None
    # A password without a user is Redis's `default` user (AUTH password).
    assert parse_sentinel_url(f"redis+sentinel://:{SECRET}@s1/m").password == SECRET


def test_the_repr_never_shows_a_password() -> None:
    url = parse_sentinel_url(f"redis+sentinel://app:{SECRET}@s1/m?sentinel_password={SECRET}")
    assert SECRET not in repr(url) and SECRET not in str(url)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (f"redis+sentinel://app:{SECRET}@s1", "needs the master's name"),
        (f"redis+sentinel://app:{SECRET}@/m", "at least one Sentinel host"),
        (f"redis+sentinel://app:{SECRET}@s1:0/m", "Sentinel address 1 of 1: the port must be a number 1-65535"),
        (f"redis+sentinel://app:{SECRET}@s1,s2:x/m", "Sentinel address 2 of 2: the port must be a number"),
        (f"redis+sentinel://app:{SECRET}@s1,,s3/m", "Sentinel address 2 of 3 has no host"),
        (f"redis+sentinel://app:{SECRET}@[fd00::7/m", "does not parse"),
        (f"redis+sentinel://app:{SECRET}@s1/m/zero", "must be a number"),
        (f"redis+sentinel://app:{SECRET}@s1/m/0/1", "nothing more"),
        (f"redis+sentinel://s1/m?password={SECRET}", "takes only the query parameters"),
        (f"redis+sentinel://s1/m?{SECRET}=1", "(not shown)"),
    ],
)
def test_a_bad_sentinel_url_says_what_is_wrong_without_quoting_it(url: str, says: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_sentinel_url(url)
    assert says in str(info.value)
    assert SECRET not in str(info.value)
