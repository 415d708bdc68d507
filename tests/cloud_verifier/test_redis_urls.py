"""SPECDEC_REDIS_URL forms: standalone, Sentinel, Cluster; a bad URL is one ValueError line that names what is
wrong and never shows the password; the settings reach the store."""

from __future__ import annotations

import logging

import pytest

from specdec_runtime.cloud_verifier.config import VerifierSettings
from specdec_runtime.cloud_verifier.store.redis_connect import CLUSTER, SENTINEL, STANDALONE, RedisTarget, parse_redis_url


@pytest.mark.parametrize("url, expected", [
    ("redis://127.0.0.1:6379/0", RedisTarget(STANDALONE, "redis://127.0.0.1:6379/0")),
    ("rediss://:pw@h:6380/2", RedisTarget(STANDALONE, "rediss://:pw@h:6380/2", tls=True)),
    ("redis+sentinel://s1:26379,s2:26380/mymaster",
     RedisTarget(SENTINEL, "redis+sentinel://s1:26379,s2:26380/mymaster", hosts=(("s1", 26379), ("s2", 26380)),
                 service_name="mymaster")),
    ("redis+sentinel://u:p%40ss@s1,s2:1/svc/3",
     RedisTarget(SENTINEL, "redis+sentinel://u:p%40ss@s1,s2:1/svc/3", hosts=(("s1", 26379), ("s2", 1)),
                 service_name="svc", db=3, username="u", password="p@ss")),
    ("rediss+sentinel://:pw@[::1]:26379/svc/",
     RedisTarget(SENTINEL, "rediss+sentinel://:pw@[::1]:26379/svc/", tls=True, hosts=(("::1", 26379),),
                 service_name="svc", password="pw")),
    ("redis+cluster://n1:7000,n2:7001,n3",
     RedisTarget(CLUSTER, "redis+cluster://n1:7000,n2:7001,n3", hosts=(("n1", 7000), ("n2", 7001), ("n3", 6379)))),
    ("rediss+cluster://app:pw@n1:7000/0",
     RedisTarget(CLUSTER, "rediss+cluster://app:pw@n1:7000/0", tls=True, hosts=(("n1", 7000),), username="app",
                 password="pw")),
])
def test_good_urls(url, expected):
    assert parse_redis_url(url) == expected


@pytest.mark.parametrize("url, says", [
    ("http://h:1/0", "scheme 'http'"),
    ("h:6379", "scheme"),
    ("redis+sentinel://s1:26379", "no service name"),
    ("redis+sentinel://s1:26379/", "no service name"),
    ("redis+sentinel:///svc", "no host"),
    ("redis+sentinel://:secret@/svc", "no host"),
    ("redis+sentinel://s1:port/svc", "port 'port' of 's1'"),
    ("redis+sentinel://s1:99999/svc", "port '99999'"),
    ("redis+sentinel://s1:1,,s2:2/svc", "empty host"),
    ("redis+sentinel://s1:1/svc/x", "database 'x'"),
    ("redis+sentinel://s1:1/svc/1/2", "database '1/2'"),
    ("redis+cluster://n1:7000/1", "only database 0"),
    ("redis+cluster://n1:7000?ssl_ca_certs=x", "query options"),
])
def test_bad_urls_name_what_is_wrong(url, says):
    with pytest.raises(ValueError) as e:
        parse_redis_url(url)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and msg.startswith("bad SPECDEC_REDIS_URL")


def test_password_never_in_errors_or_descriptions():
    with pytest.raises(ValueError) as e:
        parse_redis_url("redis+sentinel://u:hunter2@s1:notaport/svc")
    assert "hunter2" not in str(e.value) and "***" in str(e.value)
    target = parse_redis_url("redis+sentinel://u:hunter2@s1:1,s2:2/svc")
    assert "hunter2" not in target.describe() and "u:***@s1:1,s2:2/svc" in target.describe()
    assert parse_redis_url("redis://h:1/0").redacted() == "redis://h:1/0"


def test_make_store_logs_the_kind_without_password(caplog):
    """A Sentinel URL builds a Sentinel-backed store (no connection is made until a command), logged once with
    the password redacted; the sentinels' own password comes from the settings."""
    from specdec_runtime.cloud_verifier.store import make_store

    settings = VerifierSettings(redis_url="redis+sentinel://:hunter2@127.0.0.1:1/mymaster", metrics_port=0,
                                redis_sentinel_password="s3cret", redis_wait_replicas=1)
    with caplog.at_level(logging.INFO, logger="specdec_runtime.cloud_verifier.store"):
        store = make_store(settings)
    try:
        assert store.target.kind == SENTINEL and store.wait_replicas == 1
        assert "Redis sentinel at redis+sentinel://:***@127.0.0.1:1/mymaster" in caplog.text
        assert "hunter2" not in caplog.text and "s3cret" not in caplog.text
        assert "s3cret" not in repr(settings)
    finally:
        store.close()


def test_bad_url_or_prefix_in_settings_fails_at_startup():
    from specdec_runtime.cloud_verifier.store import make_store

    with pytest.raises(ValueError, match="no service name"):
        make_store(VerifierSettings(redis_url="redis+sentinel://127.0.0.1:1", metrics_port=0))
    with pytest.raises(ValueError, match="must not contain"):
        make_store(VerifierSettings(redis_url="redis://127.0.0.1:1/0", redis_prefix="x:{y}:", metrics_port=0))
